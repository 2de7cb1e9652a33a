"""The train-inference mismatch monitor: every step, the rollout engine's log-probs of the tokens it
sampled (`rollout_log_probs`) against the actor's recomputation of the same tokens (`old_log_probs`),
before the update.

The two should agree up to kernels and precision; a weight sync that loaded the wrong tensors, a
dtype or a router that differs (MoE) shows here before the reward moves, and silently wrong runs
are the complaint users repeat across RL frameworks. The statistics are
`hybridflow.algorithms.mismatch.log_prob_mismatch`; `trainer.mismatch_policy` says what a step over
`trainer.mismatch_threshold` does: `warn` prints a line and trains on, `stop` ends the run with one
`error:` line naming the metric and the step, before the update and with no checkpoint of that
state.

When responses are generated ahead (trainer.async_training) the engine sampled with an older
policy, so the statistics include that staleness as well as the engine's own difference.

With `rollout.top_k_log_probs: K` the engine also returned its K most likely tokens at each response
position and the actor its log-probs of them and its own most likely token (the old-log-prob
pass): `top_k_mismatch` compares the two distributions' shapes there (reported, never a stop).
"""

from hybridflow.algorithms.mismatch import MISMATCH_KL_METRIC, log_prob_mismatch, top_k_mismatch
from hybridflow.config.schema import TrainerConfig
from hybridflow.protocol import DataProto


class TrainInferenceMismatchError(RuntimeError):
    """A step whose engine and actor log-probs differ beyond trainer.mismatch_threshold, under
    trainer.mismatch_policy=stop; the message names the metric, its value and the step."""


def check_mismatch(batch: DataProto, cfg: TrainerConfig, step: int) -> dict[str, float]:
    """The monitor's metrics of a batch carrying `old_log_probs` (none without `rollout_log_probs`:
    rollout.calculate_log_probs=false); warns, or raises TrainInferenceMismatchError under
    mismatch_policy=stop, when mismatch/kl_k3 exceeds mismatch_threshold."""
    tensors = batch.batch
    if "rollout_log_probs" not in tensors:
        return {}
    stats = log_prob_mismatch(
        tensors["old_log_probs"],  # (B, R)
        tensors["rollout_log_probs"],  # (B, R)
        tensors["response_mask"],  # (B, R)
        cfg.mismatch_token_threshold,
    )
    stats |= top_k_metrics(batch)
    if stats[MISMATCH_KL_METRIC] > cfg.mismatch_threshold:
        report = mismatch_report(stats, cfg, step)
        if cfg.mismatch_policy == "stop":
            raise TrainInferenceMismatchError(
                f"{report}. The run stops before this step's update, with no checkpoint of this state "
                "(trainer.mismatch_policy=warn trains on)"
            )
        print(f"warning: {report}", flush=True)
    return stats


def top_k_metrics(batch: DataProto) -> dict[str, float]:
    """The full-distribution check over the response tokens; none without the engine's top-K (or
    without a response token)."""
    tensors = batch.batch
    mask = tensors["response_mask"].bool()  # (B, R)
    if "actor_top_k_log_probs" not in tensors or not mask.any():
        return {}
    return top_k_mismatch(
        tensors["rollout_top_k_ids"][mask],  # (N, K)
        tensors["rollout_top_k_log_probs"][mask],  # (N, K)
        tensors["actor_top_k_log_probs"][mask],  # (N, K)
        tensors["actor_top1_ids"][mask],  # (N,)
    )


def mismatch_report(stats: dict[str, float], cfg: TrainerConfig, step: int) -> str:
    return (
        f"step {step}: {MISMATCH_KL_METRIC} is {stats[MISMATCH_KL_METRIC]:.4g}, over "
        f"trainer.mismatch_threshold={cfg.mismatch_threshold:g}: the rollout engine's log-probs of its "
        f"samples differ from the actor's (mean |difference| {stats['mismatch/log_prob_abs_diff_mean']:.3g}, "
        f"max {stats['mismatch/log_prob_abs_diff_max']:.3g}); check the weight sync, the engine's dtype "
        "and the MoE routing"
    )
