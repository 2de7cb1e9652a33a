"""Checks of the Megatron roles' update and optimizer settings, each a ValueError naming the key.

The driver runs them on every recipe before anything starts (hybridflow/checks/) and the
engine again on what it is given directly; this module imports nothing from Megatron-Core, whose
import costs the driver 5-9 s of CPU for a model it never builds.
"""

from engines.megatron.config import (
    ActorUpdateConfig,
    CriticUpdateConfig,
    OptimConfig,
)
from hybridflow.algorithms import LOSS_AGG_MODES, policy_loss_fn
from hybridflow.algorithms.kl import KL_PENALTY_KINDS

LR_DECAY_STYLES = ("constant", "linear", "cosine")


def validate_optim_config(optim: OptimConfig) -> None:
    """Raise ValueError naming the offending key before any model is built."""
    if optim.optimizer != "adam":
        raise ValueError(
            f"optim.optimizer: only 'adam' (AdamW, decoupled weight decay) is supported, "
            f"got {optim.optimizer!r}"
        )
    if optim.lr_decay_style not in LR_DECAY_STYLES:
        raise ValueError(
            f"optim.lr_decay_style must be one of {LR_DECAY_STYLES}, got {optim.lr_decay_style!r}"
        )
    if not 0.0 <= optim.min_lr <= optim.lr:
        raise ValueError(f"optim.min_lr ({optim.min_lr}) must lie in [0, optim.lr ({optim.lr})]")
    validate_lr_limits(optim)
    if optim.clip_grad < 0 or optim.lr_warmup_iters < 0 or optim.weight_decay < 0:
        raise ValueError("optim.clip_grad, optim.lr_warmup_iters and optim.weight_decay must be >= 0")
    if optim.lr_decay_style != "constant" and (
        optim.lr_decay_iters is None or optim.lr_decay_iters <= optim.lr_warmup_iters
    ):
        raise ValueError(
            f"optim.lr_decay_style={optim.lr_decay_style!r} needs optim.lr_decay_iters greater than "
            f"optim.lr_warmup_iters ({optim.lr_warmup_iters}), got {optim.lr_decay_iters}"
        )


def validate_lr_limits(optim: OptimConfig) -> None:
    """optim.lr within optim.lr_limits, which must be [low, high] with 0 < low <= high."""
    limits = list(optim.lr_limits)
    if len(limits) != 2 or not 0 < limits[0] <= limits[1]:
        raise ValueError(
            f"optim.lr_limits must be [lowest, highest] with 0 < lowest <= highest, got {limits}"
        )
    low, high = limits
    if not low <= optim.lr <= high:
        raise ValueError(
            f"optim.lr={optim.lr:g} is outside optim.lr_limits [{low:g}, {high:g}]: an lr beyond them "
            "diverges or learns nothing (a typo?); set optim.lr_limits to allow it"
        )


def validate_update_sizes(cfg, role: str) -> None:
    """ValueError naming `<role> update <key>` unless the batch sizes, epochs and loss_agg_mode of
    an `ActorUpdateConfig` / `CriticUpdateConfig` are valid (checked before any model work)."""
    for key in ("ppo_mini_batch_size", "ppo_micro_batch_size", "ppo_epochs", "max_token_len_per_gpu"):
        if getattr(cfg, key) < 1:
            raise ValueError(f"{role} update {key} must be >= 1, got {getattr(cfg, key)}")
    if cfg.max_update_ratio is not None and not cfg.max_update_ratio > 0:
        raise ValueError(
            f"{role} update max_update_ratio must be > 0 (or null: not measured), got {cfg.max_update_ratio}"
        )
    if cfg.loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(
            f"{role} update loss_agg_mode must be one of {LOSS_AGG_MODES}, got {cfg.loss_agg_mode!r}"
        )


def validate_actor_update_config(cfg: ActorUpdateConfig) -> None:
    """ValueError naming the key, before any model work."""
    validate_update_sizes(cfg, "actor")
    if cfg.kl_loss_type not in KL_PENALTY_KINDS:
        raise ValueError(
            f"actor update kl_loss_type must be one of {KL_PENALTY_KINDS}, got {cfg.kl_loss_type!r}"
        )
    if not (0 <= cfg.clip_ratio_low < 1 and cfg.clip_ratio_high >= 0 and cfg.clip_ratio_c > 1):
        raise ValueError(
            "actor update needs 0 <= clip_ratio_low < 1, clip_ratio_high >= 0 and clip_ratio_c > 1; got "
            f"{cfg.clip_ratio_low}, {cfg.clip_ratio_high}, {cfg.clip_ratio_c}"
        )
    policy_loss_fn(cfg.policy_loss)  # a registered name, or a user's loss of the right signature
    validate_policy_loss_knobs(cfg)


def validate_policy_loss_knobs(cfg: ActorUpdateConfig) -> None:
    """The registered losses' own settings (docs/algorithms.md), whichever loss is chosen."""
    positive = ("tau_pos", "tau_neg", "clip_cov_ratio", "kl_cov_ratio")
    for key in (key for key in positive if not getattr(cfg, key) > 0):
        raise ValueError(f"actor update {key} must be > 0, got {getattr(cfg, key)}")
    if cfg.clip_cov_ratio > 1 or cfg.kl_cov_ratio > 1:
        raise ValueError(
            "actor update clip_cov_ratio and kl_cov_ratio are shares of the tokens, at most 1; got "
            f"{cfg.clip_cov_ratio}, {cfg.kl_cov_ratio}"
        )
    if not cfg.clip_cov_lb < cfg.clip_cov_ub:
        raise ValueError(
            f"actor update needs clip_cov_lb < clip_cov_ub, got {cfg.clip_cov_lb}, {cfg.clip_cov_ub}"
        )
    if cfg.ppo_kl_coef < 0:
        raise ValueError(f"actor update ppo_kl_coef must be >= 0, got {cfg.ppo_kl_coef}")
    if cfg.policy_loss == "dro" and not (cfg.dro_beta or 0) > 0:
        raise ValueError(
            "actor update policy_loss=dro needs dro_beta > 0 (the weight of its log-ratio penalty), "
            f"got {cfg.dro_beta}"
        )


def validate_critic_update_config(cfg: CriticUpdateConfig) -> None:
    """ValueError naming the key, before any model work."""
    validate_update_sizes(cfg, "critic")
    if cfg.cliprange_value <= 0:
        raise ValueError(f"critic update cliprange_value must be > 0, got {cfg.cliprange_value}")
