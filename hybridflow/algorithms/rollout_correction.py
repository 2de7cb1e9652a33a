"""The recipe's `algorithm.rollout_correction` section: corrections for responses sampled by another
policy than the one the update takes its ratio against, and the checks of its settings.

The behaviour policy mu is the rollout engine's (other kernels and precision than the actor's, the
same weights) and, in the asynchronous modes (trainer.async_training.mode one_step / async /
stream), the older version that generated the sample. The engine reports log mu of each sampled
token (`rollout_log_probs`, rollout.calculate_log_probs); the actor recomputes log pi_old of the
same tokens (`old_log_probs`). The weights' math is hybridflow/algorithms/offpolicy.py.
"""

from dataclasses import dataclass
from typing import Literal

from hybridflow.algorithms.offpolicy import IS_LEVELS, OFF_POLICY_MODES

OffPolicyMode = Literal[OFF_POLICY_MODES]
ImportanceSamplingLevel = Literal[IS_LEVELS]


@dataclass
class RolloutCorrectionConfig:
    """Weights on the policy loss from the ratio rho = pi_old / mu of the actor's recomputed
    log-probs to the rollout engine's (docs/algorithms.md). Needs rollout.calculate_log_probs: true
    (the batch then carries rollout_log_probs).

    mode "truncated_is": min(rho, upper) | "masked_is": rho inside [lower, upper], else 0, per token
    or per sequence (`level`) | "decoupled_ppo": AReaL's rho, 0 above upper (null: no cap).
    """

    mode: OffPolicyMode = "none"  # none: no correction; the others as described above
    lower: float | None = None  # masked_is: weight 0 where rho is below it; null: no lower bound
    upper: float | None = 2.0  # truncated_is: the truncation C; masked_is / decoupled_ppo: the cap
    level: ImportanceSamplingLevel = "token"  # masked_is: rho per token, or one per sequence


def validate_rollout_correction(cfg: RolloutCorrectionConfig) -> None:
    """Bounds that keep on-policy tokens (rho = 1) at weight 1, and no setting the mode ignores;
    a ValueError naming the key (under algorithm.rollout_correction)."""
    if cfg.mode in ("truncated_is", "masked_is", "decoupled_ppo") and cfg.upper is not None and cfg.upper < 1:
        raise ValueError(f"upper must be >= 1 (or null where the mode allows), got {cfg.upper}")
    if cfg.mode == "truncated_is" and cfg.upper is None:
        raise ValueError("mode=truncated_is needs upper (the truncation C, e.g. 2.0), got null")
    if cfg.mode == "masked_is" and cfg.lower is None and cfg.upper is None:
        raise ValueError("mode=masked_is needs lower and/or upper (e.g. 0.5 and 2.0)")
    if cfg.lower is not None and not (cfg.mode == "masked_is" and 0 < cfg.lower <= 1):
        raise ValueError(
            f"lower is used by mode=masked_is only, in (0, 1]; got {cfg.lower} with mode={cfg.mode}"
        )
    if cfg.level != "token" and cfg.mode != "masked_is":
        raise ValueError(f"level={cfg.level} is used by mode=masked_is only; set level: token")
