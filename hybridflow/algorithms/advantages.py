"""Advantage estimators: per-token advantages and returns from rewards on the driver.

Every estimator maps (B, R) token-level rewards and the (B, R) response mask to
`(advantages, returns)`, both (B, R) and zero on padding. Outcome estimators (GRPO, RLOO,
REINFORCE++ baseline) score a response by the sum of its token rewards and group responses
to the same prompt by `index`, a length-B array of prompt ids (the `uid` column).

`compute_advantage(name, ...)` picks one by its recipe name from `ADVANTAGE_ESTIMATORS`, or
runs a user's estimator named by dotted path (`advantage_estimator_fn`).
"""

import difflib
import math
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence

import torch

from hybridflow.algorithms.masked import masked_whiten
from hybridflow.utils.imports import import_by_path, parameter_names

KEY = "algorithm.adv_estimator"
# a user's estimator takes these and returns (advantages, returns), both (B, R)
ADVANTAGE_PARAMETERS = ("token_level_rewards", "response_mask", "index", "batch", "config")


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


def _passk_group(correct: torch.Tensor, k: int, epsilon: float) -> torch.Tensor:
    """Pass@k advantages of one group from its (G,) correct flags (`grpo_passk`)."""
    n, c = len(correct), int(correct.sum())
    mean = 1.0 - math.comb(n - c, k) / math.comb(n, k)  # share of k-subsets with a correct response
    std = math.sqrt(mean * (1.0 - mean))
    positive = (1.0 - mean) / (std + epsilon)
    # a wrong response's k-subsets pass through its k - 1 companions; none is wrong when all are right
    failing = math.comb(n - c - 1, k - 1) / math.comb(n - 1, k - 1) if c < n else 0.0
    negative = (1.0 - mean - failing) / (std + epsilon)
    return torch.where(correct, positive, negative)


def grpo_passk(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Sequence,
    k: int,
    epsilon: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pass@k training's analytical advantage (Chen et al. 2025, "Pass@k Training for Adaptively
    Balancing Exploration and Exploitation of Large Reasoning Models", arXiv:2508.10751, its
    analytical derivation).

    The reward of a k-subset of a group is 1 when one of its responses is correct (pass@k). Over
    all k-subsets of a group of n responses with c correct, its mean is R = 1 - C(n-c, k) / C(n, k)
    and its std sigma = sqrt(R (1 - R)); a correct response's advantage is (1 - R) / (sigma + eps),
    a wrong one's (1 - R - C(n-c-1, k-1) / C(n-1, k-1)) / (sigma + eps), the expected group
    advantage of the subsets it is in. k = 1 is GRPO with the population std. Scores must be 0 or 1
    (correct); k at most the group's size. Broadcast over the response's tokens.
    """
    _check_index(index, token_level_rewards.size(0))
    scores = token_level_rewards.sum(dim=-1)  # (B,)
    if not bool(((scores == 0) | (scores == 1)).all()):
        odd = scores[(scores != 0) & (scores != 1)][0].item()
        raise ValueError(
            f"{KEY}=grpo_passk needs outcome rewards of 0 or 1 (wrong or correct), got a score of {odd}; "
            "use a binary reward or another estimator"
        )
    advantages = torch.empty_like(scores)
    for rows in _group_rows(index):
        if len(rows) < k:
            raise ValueError(f"{KEY}=grpo_passk with k={k} got a group of {len(rows)} responses")
        advantages[rows] = _passk_group(scores[rows] == 1, k, epsilon).to(scores.dtype)
    advantages = advantages.unsqueeze(-1) * response_mask  # (B, R)
    return advantages, advantages


def opo(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: Sequence
) -> tuple[torch.Tensor, torch.Tensor]:
    """OPO's optimal reward baseline (Hao et al. 2025, "On-Policy RL with Optimal Reward Baseline",
    arXiv:2505.23585): b = sum_i l_i s_i / sum_i l_i over the group, each score weighted
    by its response's length l_i (valid tokens), the variance-minimising baseline when the squared
    gradient norm grows with length; A_i = s_i - b. A single-response group has no baseline
    (A = s). Broadcast over the response's tokens."""
    _check_index(index, token_level_rewards.size(0))
    scores = token_level_rewards.sum(dim=-1)  # (B,)
    lengths = response_mask.sum(dim=-1).to(scores.dtype)  # (B,)
    advantages = scores.clone()
    for rows in _group_rows(index):
        if len(rows) > 1:
            baseline = (lengths[rows] * scores[rows]).sum() / lengths[rows].sum().clamp(min=1)
            advantages[rows] = scores[rows] - baseline
    advantages = advantages.unsqueeze(-1) * response_mask  # (B, R)
    return advantages, advantages


def gpg(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: Sequence
) -> tuple[torch.Tensor, torch.Tensor]:
    """GPG's advantage (Chu et al. 2025, "GPG: A Simple and Strong Reinforcement Learning Baseline
    for Model Reasoning", arXiv:2504.02546): A_i = alpha * (s_i - mean(group)) / F_norm
    with F_norm = 1 (no std division) and the accurate-gradient-estimation factor
    alpha = B / (B - M), M the responses whose group scored all alike (their advantage is 0, so
    the batch's mean gradient would otherwise be diluted by them); alpha = 1 when every group is
    alike. A single-response group counts as alike. Broadcast over the response's tokens."""
    _check_index(index, token_level_rewards.size(0))
    scores = token_level_rewards.sum(dim=-1)  # (B,)
    centred = torch.zeros_like(scores)
    alike = 0
    for rows in _group_rows(index):
        group = scores[rows]  # (G,)
        centred[rows] = group - group.mean()
        alike += len(rows) if bool((group == group[0]).all()) else 0
    batch = scores.numel()
    alpha = batch / (batch - alike) if alike < batch else 1.0
    advantages = (alpha * centred).unsqueeze(-1) * response_mask  # (B, R)
    return advantages, advantages


def gdpo_advantages(components: torch.Tensor, index: Sequence, epsilon: float = 1e-6) -> torch.Tensor:
    """GDPO's decoupled normalisation (Liu et al. 2026, "GDPO: Group reward-Decoupled
    Normalization Policy Optimization for Multi-reward RL Optimization", arXiv:2601.05242): each
    of the K (B, K) reward components is normalised in its group on its own, (r - mean) /
    (std + eps) with the unbiased std (a single-response group keeps 0), the K are summed and the
    sum is whitened over the batch's responses. Returns (B,)."""
    _check_index(index, components.size(0))
    normalised = torch.zeros_like(components)  # (B, K)
    for rows in _group_rows(index):
        if len(rows) > 1:
            group = components[rows]  # (G, K)
            normalised[rows] = (group - group.mean(dim=0)) / (group.std(dim=0) + epsilon)
    summed = normalised.sum(dim=-1)  # (B,)
    return (summed - summed.mean()) / (summed.std() + epsilon) if summed.numel() > 1 else summed


def gdpo(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: Sequence, epsilon: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    """GDPO (`gdpo_advantages`) on the one reward a response has here, its score: the group
    normalisation of GRPO followed by a whitening over the batch's responses. Broadcast over tokens."""
    scores = token_level_rewards.sum(dim=-1, keepdim=True)  # (B, 1)
    advantages = gdpo_advantages(scores, index, epsilon).unsqueeze(-1) * response_mask  # (B, R)
    return advantages, advantages


def optimal_token_baseline(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Sequence,
    old_log_probs: torch.Tensor,
    sum_pi_squared: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The optimal token baseline (Li et al. 2026, "The Optimal Token Baseline: Variance Reduction for
    Long-Horizon LLM-RL", arXiv:2602.07078): a baseline per position of each group's responses,
    weighted by how large each response's gradient has grown up to there.

    G_t = r_t + ... + r_R is the return-to-go. The log-prob of a token y_t has the gradient
    e_{y_t} - pi_t in the logits, of squared norm w_t = 1 - 2 pi_t(y_t) + sum_v pi_t(v)^2 (the paper's
    logit-gradient proxy, from forward-pass probabilities only: `old_log_probs` (B, R) give pi_t(y_t),
    `sum_pi_squared` (B, R) the sum of squares of the same distribution), and W_t = w_1 + ... + w_t.
    The variance-minimising baseline at position t is b_t = sum_i W_{i,t} G_{i,t} / sum_i W_{i,t} over
    the group's responses still running at t, and A_{i,t} = G_{i,t} - b_t: a response alone at its
    last positions is its own baseline there (A = 0). Where every such W is 0 (each token so far had
    probability 1, so no gradient), b = 0; a single-response group has no baseline (A = G).
    Returns (advantages, G), both (B, R) and zero on padding.
    """
    _check_index(index, token_level_rewards.size(0))
    mask = response_mask.to(token_level_rewards.dtype)
    returns = (token_level_rewards * mask).flip(-1).cumsum(-1).flip(-1) * mask  # (B, R) G_t
    # a squared norm: clamp the rounding of 1 - 2 + 1 at a token of probability 1
    norms = (1 - 2 * old_log_probs.exp() + sum_pi_squared).clamp(min=0) * mask  # (B, R) w_t
    weights = norms.cumsum(-1) * mask  # (B, R) W_t
    baselines = torch.zeros_like(returns)  # (B, R)
    for rows in _group_rows(index):
        if len(rows) > 1:
            total = weights[rows].sum(dim=0)  # (R,)
            weighted = (weights[rows] * returns[rows]).sum(dim=0)  # (R,)
            positive = total.clamp(min=torch.finfo(total.dtype).tiny)
            baselines[rows] = torch.where(total > 0, weighted / positive, 0.0)  # (R,) for each row
    return (returns - baselines) * mask, returns


# name -> (estimator, the optional inputs it needs besides rewards and mask)
ADVANTAGE_ESTIMATORS = {
    "gae": (gae, ("values", "gamma", "lam")),
    "grpo": (grpo, ("index", "norm_adv_by_std", "epsilon")),
    "rloo": (rloo, ("index",)),
    "reinforce_plus_plus": (reinforce_plus_plus, ("gamma",)),
    "reinforce_plus_plus_baseline": (reinforce_plus_plus_baseline, ("index",)),
    "remax": (remax, ("reward_baselines",)),
    "grpo_passk": (grpo_passk, ("index", "k", "epsilon")),
    "opo": (opo, ("index",)),
    "gpg": (gpg, ("index",)),
    "gdpo": (gdpo, ("index", "epsilon")),
    "optimal_token_baseline": (optimal_token_baseline, ("index", "old_log_probs", "sum_pi_squared")),
}


def estimator_reads(name: str, key: str) -> bool:
    """Whether the registered estimator `name` takes `key` (e.g. `sum_pi_squared`, which the actor's
    log-prob pass computes only when asked); False for a user's estimator by dotted path."""
    return key in ADVANTAGE_ESTIMATORS.get(name, (None, ()))[1]


def advantage_estimator_fn(name: str) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """The function a dotted path `package.module.function` names, checked to take
    ADVANTAGE_PARAMETERS; a registered name's estimator otherwise. ValueError naming the key, the
    value and the fix."""
    if name in ADVANTAGE_ESTIMATORS:
        return ADVANTAGE_ESTIMATORS[name][0]
    if "." not in name and ":" not in name:
        nearest = difflib.get_close_matches(name, list(ADVANTAGE_ESTIMATORS), n=1)
        raise ValueError(
            f"unknown advantage estimator {name!r} ({KEY}); expected one of {list(ADVANTAGE_ESTIMATORS)} "
            "or a dotted path 'package.module.function' to an estimator of your own"
            + (f"; did you mean {nearest[0]!r}?" if nearest else "")
        )
    fn = import_by_path(name, KEY, "package.module.function")
    names = parameter_names(fn, name, KEY)
    if names != ADVANTAGE_PARAMETERS:
        raise ValueError(
            f"{KEY}={name!r}: {getattr(fn, '__name__', fn)} takes {names}; an advantage estimator must "
            f"take {ADVANTAGE_PARAMETERS} and return (advantages, returns), both (B, R) (docs/algorithms.md)"
        )
    return fn


def _run_user_estimator(name, token_level_rewards, response_mask, index, batch, config):
    """A user's estimator by dotted path, its two (B, R) outputs checked."""
    out = advantage_estimator_fn(name)(token_level_rewards, response_mask, index, batch, config)
    shape = tuple(token_level_rewards.shape)
    if not (isinstance(out, tuple) and len(out) == 2 and all(tuple(t.shape) == shape for t in out)):
        raise ValueError(f"{KEY}={name!r} must return (advantages, returns), both of shape {shape}")
    return out


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
    k: int | None = None,
    old_log_probs: torch.Tensor | None = None,
    sum_pi_squared: torch.Tensor | None = None,
    batch: Mapping | None = None,
    config: object = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the estimator named `name` with the inputs it needs; (advantages, returns). A dotted
    path runs a user's estimator with the batch's tensors by name (`batch`) and the algorithm
    settings (`config`)."""
    if name not in ADVANTAGE_ESTIMATORS:
        return _run_user_estimator(name, token_level_rewards, response_mask, index, batch, config)
    estimator, needed = ADVANTAGE_ESTIMATORS[name]
    given = {
        "values": values,
        "index": index,
        "reward_baselines": reward_baselines,
        "gamma": gamma,
        "lam": lam,
        "norm_adv_by_std": norm_adv_by_std,
        "epsilon": epsilon,
        "k": k,
        "old_log_probs": old_log_probs,
        "sum_pi_squared": sum_pi_squared,
    }
    missing = [key for key in needed if given[key] is None]
    if missing:
        raise ValueError(f"advantage estimator {name!r} needs {missing}, which were not given")
    return estimator(token_level_rewards, response_mask=response_mask, **{key: given[key] for key in needed})
