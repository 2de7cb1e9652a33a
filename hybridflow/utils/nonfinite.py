"""The errors a run stops with when a step must not be trained on: a number that is NaN or
infinite, or an update that would move the weights too far (the collapse guard).

Raised by the reward manager (a reward function returned NaN / inf) and by the driver (a worker
reported a non-finite loss or gradient norm, or an optimizer step whose ||dw|| / ||w|| exceeded
`<role>.update.max_update_ratio`; the workers applied neither). With `trainer.nonfinite_policy:
skip` the driver catches them, skips the step and counts it instead (nonfinite/skipped_steps).
"""

import math


class StepRefusedError(ArithmeticError):
    """A step the guards refuse to train on; the message names the step or sample and the cause."""


class NonFiniteError(StepRefusedError):
    """A NaN / inf reward, loss or gradient norm."""


class UpdateTooLargeError(StepRefusedError):
    """An optimizer step that would change the weights by more than the set fraction of their norm
    (a collapse, e.g. from an lr far too large), refused before it was applied."""


SKIPPED_SUFFIX = "/nonfinite_skipped"  # a worker's share of optimizer steps it did not apply
REFUSED_SUFFIX = "/update_refused"  # a worker's share of optimizer steps refused as too large
RATIO_SUFFIX = "/update_ratio_max"  # the largest ||dw|| / ||w|| of the step's optimizer steps
SETTING_SECTION = {"actor": "actor", "sft": "actor", "critic": "critic"}  # metric prefix -> recipe section


def nonfinite_update(step_metrics: dict[str, float]) -> list[str]:
    """What made a step non-finite, e.g. ["actor/grad_norm is nan"]: its metrics that are NaN /
    inf. A worker's skipped optimizer step shows as a non-finite `<role>/grad_norm` (the mean
    over the update's steps), so the workers' `<role>/nonfinite_skipped` entries are removed
    from `step_metrics` (the driver counts skipped steps itself)."""
    for key in [k for k in step_metrics if k.endswith(SKIPPED_SUFFIX)]:
        del step_metrics[key]
    return [f"{key} is {value}" for key, value in step_metrics.items() if not math.isfinite(value)]


def refused_updates(step_metrics: dict[str, float], cfg) -> list[str]:
    """The roles whose workers refused an optimizer step as too large, e.g. ["actor/update_ratio_max
    is 3.1e+04, over actor.update.max_update_ratio=0.25"]; removes the `<role>/update_refused`
    entries from `step_metrics` (`cfg`: the recipe, for the settings' values)."""
    problems = []
    for key in [k for k in step_metrics if k.endswith(REFUSED_SUFFIX)]:
        role = key.removesuffix(REFUSED_SUFFIX)
        if step_metrics.pop(key) > 0:
            section = SETTING_SECTION.get(role, role)
            bound = getattr(cfg, section).update.max_update_ratio
            ratio = step_metrics[role + RATIO_SUFFIX]
            problems.append(
                f"{role}{RATIO_SUFFIX} is {ratio:.3g}, over {section}.update.max_update_ratio={bound:g}"
            )
    return problems
