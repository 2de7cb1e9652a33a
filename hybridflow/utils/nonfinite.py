"""The error a run stops with when a number it would train on is NaN or infinite.

Raised by the reward manager (a reward function returned NaN / inf) and by the driver (a worker
reported a non-finite loss or gradient norm, whose update the worker did not apply). With
`trainer.nonfinite_policy: skip` the driver catches it, skips the step and counts it instead.
"""

import math


class NonFiniteError(ArithmeticError):
    """A NaN / inf reward, loss or gradient norm; the message names the step or sample and the
    quantity."""


def nonfinite_items(values: dict[str, float]) -> dict[str, float]:
    """The entries of `values` that are NaN or infinite."""
    return {key: value for key, value in values.items() if not math.isfinite(value)}
