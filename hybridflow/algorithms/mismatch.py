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


# The opt-in full-distribution check (`rollout.top_k_log_probs: K`): at every response position the
# engine reports its K most likely tokens and their log-probs (vLLM's `logprobs=K`), the actor its
# log-probs of those tokens over its whole vocabulary and its own most likely token. Sampled-token
# log-probs see one point of each distribution; this sees their shapes.
TOP_K_METRICS = ("mismatch/top_k_kl_mean", "mismatch/top_k_kl_max", "mismatch/top1_agreement")


def top_k_mismatch(
    engine_ids: torch.Tensor,
    engine_log_probs: torch.Tensor,
    actor_log_probs: torch.Tensor,
    actor_top1: torch.Tensor,
) -> dict[str, float]:
    """The engine's top-k against the actor's distribution at N positions: the KL over the engine's
    top-k support S, KL(mu_S || pi_S) with both distributions renormalised on S (so it is >= 0 and
    0 exactly when they agree there up to scale; mass outside S is what the k3 estimate on sampled
    tokens sees), its mean and max over the positions, and the share of positions whose engine
    top-1 token is the actor's most likely one.

    engine_ids (N, K) token ids, most likely first; engine_log_probs (N, K) their log mu in the
    distribution sampled from (the sampling temperature; with top-k / top-p, -inf for the tokens
    they drop); actor_log_probs (N, K) log pi of the same ids in the actor's distribution of the
    same kind (docs/sampling.md); actor_top1 (N,) the actor's most likely token. ValueError when N
    is 0."""
    if engine_ids.shape[0] == 0:
        raise ValueError("top_k_mismatch needs at least one position (the batch has no response tokens)")
    log_mu_s = engine_log_probs.float().log_softmax(-1)  # (N, K), mu renormalised on S
    log_pi_s = actor_log_probs.float().log_softmax(-1)  # (N, K), pi renormalised on S
    mu_s = log_mu_s.exp()
    # 0 log 0 = 0: a top-k entry the engine gives no mass (its sampling filters, e.g. top_k < K)
    kl = torch.where(mu_s > 0, mu_s * (log_mu_s - log_pi_s), 0.0).sum(-1)  # (N,)
    agree = engine_ids[:, 0] == actor_top1  # (N,)
    return {
        "mismatch/top_k_kl_mean": kl.mean().item(),
        "mismatch/top_k_kl_max": kl.max().item(),
        "mismatch/top1_agreement": agree.float().mean().item(),
    }
