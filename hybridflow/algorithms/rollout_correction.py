"""The recipe's `algorithm.rollout_correction` section: corrections for responses sampled by another
policy than the one the update takes its ratio against, their math, metrics and checks.

The behaviour policy mu is the rollout engine's (other kernels and precision than the actor's, the
same weights) and, in the asynchronous modes (trainer.async_training.mode one_step / async /
stream), the older version that generated the sample. The engine reports log mu of each sampled
token (`rollout_log_probs`, rollout.calculate_log_probs); the actor recomputes log pi_old of the
same tokens (`old_log_probs`); rho = pi_old / mu. Three parts, each optional, multiply into one
constant weight per token of the policy loss (`is_weights`, no gradient through it):

- `mode`: the importance weight (hybridflow/algorithms/offpolicy.py): truncated (TIS) or masked
  (MIS) at token or sequence level, or AReaL's decoupled PPO.
- `token_mask`: two-sided masking of single tokens. "icepop": weight 0 where rho lies outside
  [token_mask_low, token_mask_high] (IcePop, Ling Team 2025, "Every Step Evolves: Scaling
  Reinforcement Learning for Trillion-Scale Thinking Model", arXiv 2510.18855, sec. 3.1: alpha 0.5,
  beta 5). "kpop": weight 0 where the binary KL between pi_old(y_t) and mu(y_t) exceeds
  kpop_threshold in either direction (KPop, Guo et al., Ant Group, ringtech.notion.site/kpop, as
  AReaL and prime-rl implement it): the band is wide in ratio for rare tokens, tight for likely
  ones.
- `rejection`: rejection sampling of whole sequences: weight 0 on every token of a sequence whose
  ratio, prod_t rho_t ("sequence") or its geometric mean exp(mean_t log rho_t) ("geometric"),
  lies outside [rejection_lower, rejection_upper] (verl's rollout correction, "rs" modes; Liu et
  al. 2025, "When Speed Kills Stability", sequence-level masking).

A weight of 0 drops the token's loss but keeps it in the loss normaliser, as AReaL does.

Shapes: B sequences, R response positions; log-probs of the sampled tokens; masks hold 1 for the
tokens trained on.
"""

from dataclasses import dataclass
from typing import Literal

import torch

from hybridflow.algorithms.masked import masked_mean
from hybridflow.algorithms.offpolicy import (
    IS_LEVELS,
    OFF_POLICY_MODES,
    level_ratio,
    log_importance_ratio,
    off_policy_weights,
    sequence_log_ratio,
)

TOKEN_MASKS = ("none", "icepop", "kpop")
REJECTION_STATISTICS = ("none", "sequence", "geometric")
OffPolicyMode = Literal[OFF_POLICY_MODES]
ImportanceSamplingLevel = Literal[IS_LEVELS]
TokenMask = Literal[TOKEN_MASKS]
RejectionStatistic = Literal[REJECTION_STATISTICS]
# KPop's probabilities are kept inside (0, 1) so that log(1 - p) of a token the policy is sure of
# stays finite (prime-rl clamps the same way)
KPOP_PROB_EPS = 1e-6


@dataclass
class RolloutCorrectionConfig:
    """Weights on the policy loss from the ratio rho = pi_old / mu of the actor's recomputed
    log-probs to the rollout engine's (docs/algorithms.md, "Off-policy correction"). Any part on
    needs rollout.calculate_log_probs: true (the batch then carries rollout_log_probs).

    mode "truncated_is": min(rho, upper) | "masked_is": rho inside [lower, upper], else 0, rho per
    token or per sequence (`level`) | "decoupled_ppo": AReaL's rho, 0 above upper (null: no cap).
    token_mask and rejection multiply that weight by 0 or 1.
    """

    mode: OffPolicyMode = "none"  # none: weight 1 (masks and rejection still apply); the others as above
    lower: float | None = None  # masked_is: weight 0 where rho is below it; null: no lower bound
    upper: float | None = 2.0  # truncated_is: the truncation C; masked_is / decoupled_ppo: the cap
    level: ImportanceSamplingLevel = "token"  # truncated_is / masked_is: rho per token, or one per sequence
    # two-sided masking of single tokens: icepop (rho outside [token_mask_low, token_mask_high]) |
    # kpop (binary KL of the token's probabilities over kpop_threshold either way) | none
    token_mask: TokenMask = "none"
    token_mask_low: float = 0.5  # icepop: tokens whose rho is below this get weight 0 (IcePop's alpha)
    token_mask_high: float = 5.0  # icepop: tokens whose rho is above this get weight 0 (IcePop's beta)
    kpop_threshold: float = 0.1  # kpop: the binary KL above which a token gets weight 0 (KPop's phi)
    # reject whole sequences whose ratio leaves [rejection_lower, rejection_upper]: sequence (prod_t
    # rho_t) | geometric (its geometric mean, exp(mean_t log rho_t)) | none
    rejection: RejectionStatistic = "none"
    rejection_lower: float | None = None  # rejection: sequences below it are rejected; null: no bound
    rejection_upper: float | None = None  # rejection: sequences above it are rejected; null: no bound


def active_parts(cfg: RolloutCorrectionConfig) -> list[str]:
    """The parts switched on, as `key=value` (empty: no correction)."""
    parts = {"mode": cfg.mode, "token_mask": cfg.token_mask, "rejection": cfg.rejection}
    return [f"{key}={value}" for key, value in parts.items() if value != "none"]


def icepop_token_mask(
    old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, low: float, high: float
) -> torch.Tensor:
    """IcePop's two-sided mask (arXiv 2510.18855, M(k) = k if alpha <= k <= beta else 0): True
    where low <= rho_t <= high. (B, R) -> (B, R) bool"""
    ratio = log_importance_ratio(old_log_prob, rollout_log_prob).exp()  # (B, R)
    return (ratio >= low) & (ratio <= high)


def binary_kl(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """KL between the two-outcome distributions (this token, any other): p log(p / q) + (1 - p)
    log((1 - p) / (1 - q)), p and q clamped into [eps, 1 - eps]. (B, R) -> (B, R)"""
    p = log_p.exp().clamp(KPOP_PROB_EPS, 1 - KPOP_PROB_EPS)  # (B, R)
    q = log_q.exp().clamp(KPOP_PROB_EPS, 1 - KPOP_PROB_EPS)  # (B, R)
    return p * (p.log() - q.log()) + (1 - p) * ((1 - p).log() - (1 - q).log())


def kpop_token_mask(
    old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, threshold: float
) -> torch.Tensor:
    """KPop's mask: True where the binary KL of pi_old(y_t) and mu(y_t) is at most `threshold` in
    both directions. (B, R) -> (B, R) bool"""
    old, rollout = old_log_prob.detach(), rollout_log_prob.detach()
    return (binary_kl(old, rollout) <= threshold) & (binary_kl(rollout, old) <= threshold)


def sequence_acceptance(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    statistic: str,
    lower: float | None,
    upper: float | None,
) -> torch.Tensor:
    """Rejection sampling of whole sequences: True for a sequence whose ratio lies in [lower, upper]
    (a None bound is open); the ratio is prod_t rho_t ("sequence") or exp(mean_t log rho_t)
    ("geometric") over its valid tokens. (B, R) -> (B, 1) bool"""
    log_ratio = log_importance_ratio(old_log_prob, rollout_log_prob)  # (B, R)
    if statistic == "sequence":
        seq_log_ratio = sequence_log_ratio(log_ratio, response_mask)  # (B, 1)
    elif statistic == "geometric":
        lengths = response_mask.sum(-1, keepdim=True).clamp(min=1)  # (B, 1)
        seq_log_ratio = (log_ratio * response_mask).sum(-1, keepdim=True) / lengths  # (B, 1)
    else:
        raise ValueError(f"rejection statistic must be sequence or geometric, got {statistic!r}")
    ratio = seq_log_ratio.exp()  # (B, 1)
    accept = torch.ones_like(ratio, dtype=torch.bool)
    if lower is not None:
        accept &= ratio >= lower
    if upper is not None:
        accept &= ratio <= upper
    return accept


def effective_sample_size(weights: torch.Tensor, response_mask: torch.Tensor) -> float:
    """Kish's effective sample size of the weights of the N valid tokens, normalised by N:
    (sum w)^2 / (N sum w^2), in (0, 1]; 1 when all weights are equal, 0 when all are 0.
    (B, R) each -> ()"""
    w = weights[response_mask.bool()]  # (N,)
    square_sum = w.square().sum()
    if w.numel() == 0 or square_sum == 0:
        return 0.0
    return (w.sum().square() / (w.numel() * square_sum)).item()


def token_keep(cfg: RolloutCorrectionConfig, old_log_prob, rollout_log_prob) -> torch.Tensor | None:
    """The token mask of `cfg.token_mask` (None for "none"). (B, R) -> (B, R) bool"""
    if cfg.token_mask == "icepop":
        return icepop_token_mask(old_log_prob, rollout_log_prob, cfg.token_mask_low, cfg.token_mask_high)
    if cfg.token_mask == "kpop":
        return kpop_token_mask(old_log_prob, rollout_log_prob, cfg.kpop_threshold)
    return None


def sequence_keep(cfg: RolloutCorrectionConfig, old_log_prob, rollout_log_prob, response_mask):
    """The accepted sequences of `cfg.rejection` (None for "none"). (B, R) -> (B, 1) bool"""
    if cfg.rejection == "none":
        return None
    return sequence_acceptance(
        old_log_prob, rollout_log_prob, response_mask, cfg.rejection, cfg.rejection_lower, cfg.rejection_upper
    )


def rollout_correction_weights(
    cfg: RolloutCorrectionConfig,
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
) -> tuple[torch.Tensor | None, dict[str, float]]:
    """The weights of every part of `cfg` multiplied (None when none is on) and their metrics
    (`correction_metrics`). (B, R) each -> (B, R), floats"""
    if not active_parts(cfg):
        return None, {}
    ones = torch.ones_like(old_log_prob)
    is_weights = off_policy_weights(
        cfg.mode, old_log_prob, rollout_log_prob, response_mask, cfg.lower, cfg.upper, cfg.level
    )  # (B, R) or None
    is_weights = ones if is_weights is None else is_weights
    kept = token_keep(cfg, old_log_prob, rollout_log_prob)  # (B, R) or None
    accepted = sequence_keep(cfg, old_log_prob, rollout_log_prob, response_mask)  # (B, 1) or None
    weights = (
        is_weights * (ones if kept is None else kept) * (ones if accepted is None else accepted)
    )  # (B, R)
    clipped = torch.zeros_like(response_mask, dtype=torch.bool)
    if cfg.mode == "truncated_is":
        clipped = is_weights < level_ratio(old_log_prob, rollout_log_prob, response_mask, cfg.level)
    return weights, correction_metrics(weights, clipped, kept, accepted, response_mask)


def correction_metrics(
    weights: torch.Tensor,
    clipped: torch.Tensor,
    kept: torch.Tensor | None,
    accepted: torch.Tensor | None,
    response_mask: torch.Tensor,
) -> dict[str, float]:
    """Over the valid tokens: the weights' mean and max, the share truncation lowered below the
    ratio (is_clipped_frac), the share given weight 0 by any part (is_masked_frac) and the
    effective sample size (is_ess); with a token mask the share it dropped (token_mask_frac); with
    rejection the share of sequences (those with a valid token) rejected (rejection_rate).
    weights, clipped, kept, response_mask (B, R); accepted (B, 1) -> floats"""
    mask = response_mask.bool()  # (B, R)
    metrics = {
        "is_weight_mean": masked_mean(weights, mask).item(),
        "is_weight_max": weights[mask].max().item() if mask.any() else 0.0,
        "is_clipped_frac": masked_mean((clipped & mask).float(), mask).item(),
        "is_masked_frac": masked_mean(((weights == 0) & mask).float(), mask).item(),
        "is_ess": effective_sample_size(weights, mask),
    }
    if kept is not None:
        metrics["token_mask_frac"] = masked_mean((~kept & mask).float(), mask).item()
    if accepted is not None:
        sequences = mask.any(-1)  # (B,)
        rejected = ~accepted.squeeze(-1) & sequences  # (B,)
        metrics["rejection_rate"] = (rejected.sum() / sequences.sum().clamp(min=1)).item()
    return metrics


def validate_rollout_correction(cfg: RolloutCorrectionConfig) -> None:
    """Bounds that keep on-policy tokens (rho = 1) at weight 1, and no setting its part ignores; a
    ValueError naming the key (under algorithm.rollout_correction)."""
    _check_importance_weights(cfg)
    if cfg.token_mask == "icepop" and not 0 < cfg.token_mask_low <= 1 <= cfg.token_mask_high:
        raise ValueError(
            "token_mask=icepop needs 0 < token_mask_low <= 1 <= token_mask_high (IcePop: 0.5 and 5), "
            f"got {cfg.token_mask_low} and {cfg.token_mask_high}"
        )
    if cfg.token_mask == "kpop" and not cfg.kpop_threshold > 0:
        raise ValueError(f"token_mask=kpop needs kpop_threshold > 0 (KPop: 0.1), got {cfg.kpop_threshold}")
    _check_rejection(cfg)


def _check_importance_weights(cfg: RolloutCorrectionConfig) -> None:
    if cfg.mode != "none" and cfg.upper is not None and cfg.upper < 1:
        raise ValueError(f"upper must be >= 1 (or null where the mode allows), got {cfg.upper}")
    if cfg.mode == "truncated_is" and cfg.upper is None:
        raise ValueError("mode=truncated_is needs upper (the truncation C, e.g. 2.0), got null")
    if cfg.mode == "masked_is" and cfg.lower is None and cfg.upper is None:
        raise ValueError("mode=masked_is needs lower and/or upper (e.g. 0.5 and 2.0)")
    if cfg.lower is not None and not (cfg.mode == "masked_is" and 0 < cfg.lower <= 1):
        raise ValueError(
            f"lower is used by mode=masked_is only, in (0, 1]; got {cfg.lower} with mode={cfg.mode}"
        )
    if cfg.level != "token" and cfg.mode not in ("truncated_is", "masked_is"):
        raise ValueError(
            f"level={cfg.level} is used by mode=truncated_is and mode=masked_is only; set level: token"
        )


def _check_rejection(cfg: RolloutCorrectionConfig) -> None:
    bounds = (cfg.rejection_lower, cfg.rejection_upper)
    if cfg.rejection == "none" and bounds != (None, None):
        raise ValueError(
            "rejection_lower / rejection_upper are used by rejection=sequence or rejection=geometric "
            "only; set rejection or remove them"
        )
    if cfg.rejection != "none" and bounds == (None, None):
        raise ValueError(
            f"rejection={cfg.rejection} needs rejection_lower and/or rejection_upper (e.g. 0.5 and 2.0)"
        )
    if cfg.rejection_lower is not None and not 0 < cfg.rejection_lower <= 1:
        raise ValueError(f"rejection_lower must be in (0, 1], got {cfg.rejection_lower}")
    if cfg.rejection_upper is not None and cfg.rejection_upper < 1:
        raise ValueError(f"rejection_upper must be >= 1, got {cfg.rejection_upper}")
