"""KL divergence between the policy and the reference: per-token estimators, the KL
coefficient controllers, and the KL penalty folded into the token-level reward.
"""

from dataclasses import dataclass

import torch

from hybridflow.algorithms.masked import masked_mean

KL_PENALTY_KINDS = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")


def kl_penalty(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from the sampled tokens' log-probs, (B, R).

    Estimators from Schulman 2020, "Approximating KL Divergence" (joschu.net/blog/kl-approx):
    - "kl"/"k1": log r, with log r = log pi - log pi_ref (unbiased, high variance);
    - "abs": |log r|;
    - "mse"/"k2": 0.5 * (log r)^2 (biased, low variance);
    - "low_var_kl"/"k3": exp(-log r) - 1 + log r (unbiased, non-negative), clamped to
      [-10, 10] as is usual for stability.
    """
    if kind not in KL_PENALTY_KINDS:
        raise ValueError(f"KL penalty kind must be one of {KL_PENALTY_KINDS}, got {kind!r}")
    log_ratio = log_prob - ref_log_prob  # (B, R)
    if kind in ("kl", "k1"):
        return log_ratio
    if kind == "abs":
        return log_ratio.abs()
    if kind in ("mse", "k2"):
        return 0.5 * log_ratio.square()
    # exp(20) is finite in fp32; the clamp keeps the estimate from overflowing
    reverse_log_ratio = (-log_ratio).clamp(-20.0, 20.0)
    return (torch.exp(reverse_log_ratio) - reverse_log_ratio - 1.0).clamp(-10.0, 10.0)


@dataclass
class FixedKLController:
    """A constant KL coefficient."""

    value: float

    def update(self, current_kl: float, n_steps: int) -> None:
        """Nothing to adapt; present so both controllers are used the same way."""


@dataclass
class AdaptiveKLController:
    """Adaptive KL coefficient (Ziegler et al. 2019, "Fine-Tuning Language Models from Human
    Preferences", section 2.2): beta <- beta * (1 + clip(KL / target - 1, -0.2, 0.2) * n / horizon).
    """

    value: float
    target: float
    horizon: float

    def __post_init__(self) -> None:
        if self.target <= 0 or self.horizon <= 0:
            raise ValueError(f"target ({self.target}) and horizon ({self.horizon}) must be positive")

    def update(self, current_kl: float, n_steps: int) -> None:
        proportional_error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + proportional_error * n_steps / self.horizon


def apply_kl_penalty(
    token_level_scores: torch.Tensor,
    old_log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    kl_ctrl: FixedKLController | AdaptiveKLController,
    kind: str = "kl",
) -> tuple[torch.Tensor, dict[str, float]]:
    """KL-in-reward (Ziegler et al. 2019; Ouyang et al. 2022): r_t = s_t - beta * KL_t.

    Inputs are (B, R). Returns the (B, R) token-level rewards and the metrics
    `reward_kl_penalty` (the batch mean of each sequence's mean token KL) and
    `reward_kl_penalty_coeff` (the beta used). The controller is then updated with that
    KL over B steps; this is the function's one side effect.
    """
    kld = kl_penalty(old_log_prob, ref_log_prob, kind) * response_mask  # (B, R)
    beta = kl_ctrl.value
    token_level_rewards = token_level_scores - beta * kld
    current_kl = masked_mean(kld, response_mask, dim=-1).mean().item()
    kl_ctrl.update(current_kl, n_steps=token_level_scores.size(0))
    return token_level_rewards, {"reward_kl_penalty": current_kl, "reward_kl_penalty_coeff": beta}
