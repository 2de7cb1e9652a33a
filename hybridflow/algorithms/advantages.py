"""Advantage estimators: per-token advantages and returns from rewards on the driver.

Every estimator maps (B, R) token-level rewards and the (B, R) response mask to
`(advantages, returns)`, both (B, R) and zero on padding. Outcome estimators (GRPO, RLOO,
REINFORCE++ baseline) score a response by the sum of its token rewards and group responses
to the same prompt by `index`, a length-B array of prompt ids (the `uid` column).

`compute_advantage(name, ...)` picks one by its recipe name from `ADVANTAGE_ESTIMATORS`.
"""

from collections import defaultdict
from collections.abc import Sequence

import torch

from hybridflow.algorithms.masked import masked_whiten


def gae(
    token_level_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016, "High-Dimensional Continuous
    Control Using Generalized Advantage Estimation").

    delta_t = r_t + gamma * V_{t+1} - V_t,  A_t = delta_t + gamma * lam * A_{t+1}, with V = 0
    after the last valid token. Masked positions are skipped (the recursion carries over
    them), so padding values never leak into a valid token's delta. Returns = A + V, taken
    before the advantages are whitened over the valid tokens.
    """
    mask = response_mask.to(values.dtype)
    next_value = torch.zeros_like(values[:, 0])  # (B,)
    next_advantage = torch.zeros_like(values[:, 0])  # (B,)
    advantages_reversed = []
    for t in reversed(range(values.size(1))):
        delta = token_level_rewards[:, t] + gamma * next_value - values[:, t]  # (B,)
        advantage = delta + gamma * lam * next_advantage  # (B,)
        valid = mask[:, t]
        next_advantage = valid * advantage + (1 - valid) * next_advantage
        next_value = valid * values[:, t] + (1 - valid) * next_value
        advantages_reversed.append(next_advantage)
    advantages = torch.stack(advantages_reversed[::-1], dim=1)  # (B, R)
    returns = (advantages + values) * mask
    return masked_whiten(advantages, mask) * mask, returns


def _group_rows(index: Sequence) -> list[list[int]]:
    """Row numbers of each group of equal `index` values, in first-seen order."""
    groups: dict = defaultdict(list)
    for row, key in enumerate(index):
        groups[key].append(row)
    return list(groups.values())


def _check_index(index: Sequence, batch_size: int) -> None:
    if len(index) != batch_size:
        raise ValueError(f"index has {len(index)} entries but the batch has {batch_size} responses")


def grpo(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Sequence,
    norm_adv_by_std: bool = True,
    epsilon: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO outcome advantage (Shao et al. 2024, "DeepSeekMath", section 4.1.2).

    A_i = (s_i - mean(group)) / (std(group) + epsilon), or s_i - mean(group) without std
    normalisation (Dr. GRPO, Liu et al. 2025); std is the unbiased sample std. A group of a
    single response has no baseline: its advantage is its score. Broadcast over its tokens.
    """
    _check_index(index, token_level_rewards.size(0))
    scores = token_level_rewards.sum(dim=-1)  # (B,)
    advantages = torch.empty_like(scores)
    for rows in _group_rows(index):
        group = scores[rows]  # (G,)
        if len(rows) == 1:
            advantages[rows] = group
            continue
        centred = group - group.mean()
        advantages[rows] = centred / (group.std() + epsilon) if norm_adv_by_std else centred
    advantages = advantages.unsqueeze(-1) * response_mask  # (B, R)
    return advantages, advantages


def rloo(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: Sequence
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE leave-one-out (Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE
    Style Optimization for Learning from Human Feedback in LLMs").

    A_i = s_i - mean of the other responses' scores in the group; a single-response group
    has no baseline (A = s). Broadcast over the response's tokens.
    """
    _check_index(index, token_level_rewards.size(0))
    scores = token_level_rewards.sum(dim=-1)  # (B,)
    advantages = scores.clone()
    for rows in _group_rows(index):
        if len(rows) > 1:
            group = scores[rows]  # (G,)
            advantages[rows] = group - (group.sum() - group) / (len(rows) - 1)
    advantages = advantages.unsqueeze(-1) * response_mask  # (B, R)
    return advantages, advantages


def _discounted_returns(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float):
    """G_t = r_t + gamma * G_{t+1} over valid tokens; the running sum restarts at padding."""
    mask = response_mask.to(token_level_rewards.dtype)
    running = torch.zeros_like(token_level_rewards[:, 0])  # (B,)
    returns_reversed = []
    for t in reversed(range(token_level_rewards.size(1))):
        running = (token_level_rewards[:, t] + gamma * running) * mask[:, t]
        returns_reversed.append(running)
    return torch.stack(returns_reversed[::-1], dim=1)  # (B, R)


def reinforce_plus_plus(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu 2025, "REINFORCE++: A Simple and Efficient Approach for Aligning
    Large Language Models"): discounted returns, whitened over the batch's valid tokens."""
    returns = _discounted_returns(token_level_rewards, response_mask, gamma)  # (B, R)
    advantages = masked_whiten(returns, response_mask) * response_mask
    return advantages, returns


def reinforce_plus_plus_baseline(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: Sequence
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ with a group baseline (Hu 2025, section on REINFORCE++-baseline): subtract
    the group's mean score (none for a single-response group), broadcast over tokens, then
    whiten over the batch's valid tokens."""
    _check_index(index, token_level_rewards.size(0))
    scores = token_level_rewards.sum(dim=-1)  # (B,)
    centred = scores.clone()
    for rows in _group_rows(index):
        if len(rows) > 1:
            centred[rows] = scores[rows] - scores[rows].mean()
    token_scores = centred.unsqueeze(-1) * response_mask  # (B, R)
    advantages = masked_whiten(token_scores, response_mask) * response_mask
    return advantages, advantages


def remax(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, reward_baselines: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax (Li et al. 2023, "ReMax: A Simple, Effective, and Efficient Reinforcement
    Learning Method for Aligning LLMs"): return-to-go minus the (B,) reward of the greedy
    response to the same prompt."""
    returns = (token_level_rewards * response_mask).flip(-1).cumsum(-1).flip(-1)  # (B, R)
    advantages = returns - reward_baselines.unsqueeze(-1) * response_mask
    return advantages, returns


# name -> (estimator, the optional inputs it needs besides rewards and mask)
ADVANTAGE_ESTIMATORS = {
    "gae": (gae, ("values", "gamma", "lam")),
    "grpo": (grpo, ("index", "norm_adv_by_std", "epsilon")),
    "rloo": (rloo, ("index",)),
    "reinforce_plus_plus": (reinforce_plus_plus, ("gamma",)),
    "reinforce_plus_plus_baseline": (reinforce_plus_plus_baseline, ("index",)),
    "remax": (remax, ("reward_baselines",)),
}


def compute_advantage(
    name: str,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    values: torch.Tensor | None = None,
    index: Sequence | None = None,
    reward_baselines: torch.Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    norm_adv_by_std: bool = True,
    epsilon: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the estimator named `name` with the inputs it needs; (advantages, returns)."""
    if name not in ADVANTAGE_ESTIMATORS:
        known = sorted(ADVANTAGE_ESTIMATORS)
        raise ValueError(f"unknown advantage estimator {name!r}; expected one of {known}")
    estimator, needed = ADVANTAGE_ESTIMATORS[name]
    given = {
        "values": values,
        "index": index,
        "reward_baselines": reward_baselines,
        "gamma": gamma,
        "lam": lam,
        "norm_adv_by_std": norm_adv_by_std,
        "epsilon": epsilon,
    }
    missing = [key for key in needed if given[key] is None]
    if missing:
        raise ValueError(f"advantage estimator {name!r} needs {missing}, which were not given")
    return estimator(token_level_rewards, response_mask=response_mask, **{k: given[k] for k in needed})
