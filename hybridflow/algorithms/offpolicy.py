"""Off-policy correction from the rollout engine's own log-probs: per-token weights on the policy
loss, and the statistics that show how far the samples are off-policy.

The responses are sampled by the engine's policy mu (the behaviour policy: an older version in
asynchronous training, or the same weights under other kernels and precision), while the PPO
ratio is taken against pi_old, the actor's recomputed log-probs of the same tokens (the proximal
policy in AReaL's words). The correction weights each token's loss by a function of the
importance ratio rho = pi_old / mu (docs/async.md gives the math):

- `truncated_is`: min(rho, upper), per token or per sequence. Yao et al. 2025, "Your Efficient
  RL Framework Secretly Brings You Off-Policy RL Training".
- `masked_is`: rho inside [lower, upper], else 0, per token or per sequence. Liu et al. 2025,
  "When Speed Kills Stability: Demystifying RL Collapse from the Training-Inference Mismatch".
- `decoupled_ppo`: rho, 0 above upper (null: no cap). Fu et al. 2025, "AReaL: A Large-Scale
  Asynchronous Reinforcement Learning System for Language Reasoning", eq. 5.

Weights are constants of the batch (no gradient flows through them). A weight of 0 drops the
token's loss but keeps it in the loss normaliser, as AReaL does.

Shapes: B sequences, R response positions; log-probs are of the sampled tokens; masks hold 1 for
the tokens trained on.
"""

import torch

from hybridflow.algorithms.masked import masked_mean

OFF_POLICY_MODES = ("none", "truncated_is", "masked_is", "decoupled_ppo")
IS_LEVELS = ("token", "sequence")
# exp() of a larger log-ratio overflows float32; such a token is clipped or masked anyway
MAX_LOG_RATIO = 20.0


def log_importance_ratio(old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor) -> torch.Tensor:
    """log(pi_old / mu) per token, clamped to +-MAX_LOG_RATIO. (B, R) -> (B, R)"""
    return (old_log_prob - rollout_log_prob).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO).detach()


def sequence_log_ratio(log_ratio: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """log prod_t rho_t over each sequence's valid tokens, clamped to +-MAX_LOG_RATIO. (B, R) -> (B, 1)"""
    return (log_ratio * response_mask).sum(-1, keepdim=True).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)


def level_ratio(
    old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, response_mask: torch.Tensor, level: str
) -> torch.Tensor:
    """rho per token ("token"), or the sequence's prod_t rho_t on each of its tokens ("sequence").
    (B, R) -> (B, R)"""
    if level not in IS_LEVELS:
        raise ValueError(f"importance sampling level must be one of {IS_LEVELS}, got {level!r}")
    log_ratio = log_importance_ratio(old_log_prob, rollout_log_prob)  # (B, R)
    if level == "sequence":
        log_ratio = sequence_log_ratio(log_ratio, response_mask).expand_as(log_ratio)  # (B, R)
    return log_ratio.exp()


def truncated_is_weights(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    cap: float,
    response_mask: torch.Tensor | None = None,
    level: str = "token",
) -> torch.Tensor:
    """Truncated importance sampling (Yao et al. 2025): w = min(rho, C), rho per token, or per
    sequence (prod_t rho_t over its valid tokens, needs `response_mask`). (B, R) -> (B, R)"""
    mask = torch.ones_like(old_log_prob) if response_mask is None else response_mask
    return level_ratio(old_log_prob, rollout_log_prob, mask, level).clamp(max=cap)


def masked_is_weights(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    lower: float | None,
    upper: float | None,
    level: str = "token",
) -> torch.Tensor:
    """Masked importance sampling (Liu et al. 2025): w = rho where rho lies in [lower, upper], else 0
    (a None bound is open). level "token": rho per token; "sequence": rho = prod_t rho_t over the
    sequence's valid tokens, the same weight on each of them, a whole sequence masked together.
    (B, R) -> (B, R)"""
    ratio = level_ratio(old_log_prob, rollout_log_prob, response_mask, level)  # (B, R)
    inside = torch.ones_like(ratio, dtype=torch.bool)
    if lower is not None:
        inside &= ratio >= lower
    if upper is not None:
        inside &= ratio <= upper
    return torch.where(inside, ratio, torch.zeros_like(ratio))


def decoupled_ppo_weights(
    proximal_log_prob: torch.Tensor, behaviour_log_prob: torch.Tensor, cap: float | None
) -> torch.Tensor:
    """AReaL's decoupled PPO (Fu et al. 2025, eq. 5): the clipped PPO term is taken against the
    proximal policy (the recomputed old log-probs) and weighted by pi_prox / pi_behav, the
    behaviour policy being the rollout's; tokens whose weight exceeds `cap` are dropped (AReaL's
    behav_imp_weight_cap; None keeps all). (B, R) -> (B, R)"""
    ratio = log_importance_ratio(proximal_log_prob, behaviour_log_prob).exp()  # (B, R)
    if cap is None:
        return ratio
    return torch.where(ratio <= cap, ratio, torch.zeros_like(ratio))


def off_policy_weights(
    mode: str,
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    lower: float | None = None,
    upper: float | None = None,
    level: str = "token",
) -> torch.Tensor | None:
    """The weights of `mode` (one of OFF_POLICY_MODES; None for "none"), with the bounds as the
    mode reads them: truncated_is caps at `upper` and masked_is keeps [lower, upper], each at
    `level`; decoupled_ppo drops weights above `upper`. (B, R) -> (B, R)"""
    if mode == "none":
        return None
    if mode == "truncated_is":
        if upper is None:
            raise ValueError("truncated_is needs an upper bound (the truncation C)")
        return truncated_is_weights(old_log_prob, rollout_log_prob, upper, response_mask, level)
    if mode == "masked_is":
        return masked_is_weights(old_log_prob, rollout_log_prob, response_mask, lower, upper, level)
    if mode == "decoupled_ppo":
        return decoupled_ppo_weights(old_log_prob, rollout_log_prob, upper)
    raise ValueError(f"off-policy mode must be one of {OFF_POLICY_MODES}, got {mode!r}")


def rollout_mismatch_kl(
    old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, response_mask: torch.Tensor
) -> float:
    """Mean per-token k3 estimate of KL(mu || pi_old) from tokens sampled by mu (Schulman 2020,
    "Approximating KL Divergence"): rho - 1 - log rho, rho = pi_old / mu; >= 0, 0 when the
    engine and the actor agree. (B, R) -> ()"""
    log_ratio = log_importance_ratio(old_log_prob, rollout_log_prob)  # (B, R)
    return masked_mean(log_ratio.exp() - 1 - log_ratio, response_mask).item()
