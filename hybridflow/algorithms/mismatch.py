"""How far the rollout engine's policy is from the actor's on the same weights: the train-inference
mismatch monitor's math.

The engine samples each token from its own distribution mu (other kernels, precision, batch
shapes, and in MoE models possibly other experts) and reports log mu(token) (`rollout_log_probs`);
the actor recomputes log pi(token) for the same tokens (`old_log_probs`). When they differ the
samples are off-policy for the policy trained (Yao et al. 2025, "Your Efficient RL Framework
Secretly Brings You Off-Policy RL Training"; Liu et al. 2025, "When Speed Kills Stability"). A
corrupted weight sync shows here first, long before the reward moves.

Statistics over the response tokens: the mean and max of |log pi - log mu|, the share of tokens
whose |log pi - log mu| exceeds a threshold, and the k3 estimate of KL(mu || pi) from mu's samples
(Schulman 2020, "Approximating KL Divergence": rho - 1 - log rho with rho = pi / mu; unbiased,
always >= 0).

Shapes: B sequences, R response positions.
"""

import torch

from hybridflow.algorithms.masked import masked_mean
from hybridflow.algorithms.offpolicy import log_importance_ratio

MISMATCH_KL_METRIC = "mismatch/kl_k3"
MISMATCH_METRICS = (
    "mismatch/log_prob_abs_diff_mean",
    "mismatch/log_prob_abs_diff_max",
    MISMATCH_KL_METRIC,
    "mismatch/tokens_over_threshold",
)


def log_prob_mismatch(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    token_threshold: float,
) -> dict[str, float]:
    """The monitor's per-step statistics over the tokens where `response_mask` is 1 (all 0.0 when
    there are none). (B, R) each -> floats"""
    mask = response_mask.bool()  # (B, R)
    if not mask.any():
        return dict.fromkeys(MISMATCH_METRICS, 0.0)
    abs_diff = (old_log_prob - rollout_log_prob).abs()  # (B, R)
    log_ratio = log_importance_ratio(old_log_prob, rollout_log_prob)  # (B, R), log(pi / mu)
    k3 = log_ratio.exp() - 1 - log_ratio  # (B, R)
    return {
        "mismatch/log_prob_abs_diff_mean": masked_mean(abs_diff, mask).item(),
        "mismatch/log_prob_abs_diff_max": abs_diff[mask].max().item(),
        MISMATCH_KL_METRIC: masked_mean(k3, mask).item(),
        "mismatch/tokens_over_threshold": masked_mean((abs_diff > token_threshold).float(), mask).item(),
    }
