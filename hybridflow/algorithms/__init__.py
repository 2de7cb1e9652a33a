"""Pure RL math (tensors in, tensors out): advantage estimators, policy / value / KL losses,
KL coefficient control, DAPO's group filter and overlong penalty. Imports only torch (and
hybridflow.utils.imports, to load a user's policy loss or estimator by dotted path)."""

from hybridflow.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    compute_advantage,
    gae,
    grpo,
    reinforce_plus_plus,
    reinforce_plus_plus_baseline,
    remax,
    rloo,
)
from hybridflow.algorithms.dapo import groups_with_reward_variance, overlong_penalty
from hybridflow.algorithms.kl import AdaptiveKLController, FixedKLController, apply_kl_penalty, kl_penalty
from hybridflow.algorithms.losses import (
    LOSS_AGG_MODES,
    agg_loss,
    compute_policy_loss,
    compute_policy_loss_gspo,
    compute_value_loss,
)
from hybridflow.algorithms.masked import compute_response_mask, masked_mean, masked_sum, masked_whiten
from hybridflow.algorithms.policy_losses import POLICY_LOSS_FNS, POLICY_LOSSES, policy_loss_fn

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "LOSS_AGG_MODES",
    "POLICY_LOSSES",
    "POLICY_LOSS_FNS",
    "AdaptiveKLController",
    "FixedKLController",
    "agg_loss",
    "apply_kl_penalty",
    "compute_advantage",
    "compute_policy_loss",
    "compute_policy_loss_gspo",
    "compute_response_mask",
    "compute_value_loss",
    "gae",
    "groups_with_reward_variance",
    "grpo",
    "kl_penalty",
    "masked_mean",
    "masked_sum",
    "masked_whiten",
    "overlong_penalty",
    "policy_loss_fn",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
    "remax",
    "rloo",
]
