"""The error a run stops with when a number it would train on is NaN or infinite.

Raised by the reward manager (a reward function returned NaN / inf) and by the driver (a worker
reported a non-finite loss or gradient norm, whose update the worker did not apply). With
`trainer.nonfinite_policy: skip` the driver catches it, skips the step and counts it instead.
"""

import math


class NonFiniteError(ArithmeticError):
    """A NaN / inf reward, loss or gradient norm; the message names the step or sample and the
    quantity."""


SKIPPED_SUFFIX = "/nonfinite_skipped"  # a worker's share of optimizer steps it did not apply


def nonfinite_update(step_metrics: dict[str, float]) -> list[str]:
    """What made a step non-finite, e.g. ["actor/grad_norm is nan"]: its metrics that are NaN /
    inf. A worker's skipped optimizer step shows as a non-finite `<role>/grad_norm` (the mean
    over the update's steps), so the workers' `<role>/nonfinite_skipped` entries are removed
    from `step_metrics` (the driver counts skipped steps itself)."""
    for key in [k for k in step_metrics if k.endswith(SKIPPED_SUFFIX)]:
        del step_metrics[key]
    return [f"{key} is {value}" for key, value in step_metrics.items() if not math.isfinite(value)]
