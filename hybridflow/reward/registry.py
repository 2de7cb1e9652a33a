"""Which rule scores which data source, and loading a user's reward function by dotted path.

A custom reward function has the fixed signature
`fn(data_source, solution_str, ground_truth, extra_info) -> float` (tests pin it).
"""

import inspect
from collections.abc import Callable

from hybridflow.data.reasoning_gym import SOURCE_PREFIX
from hybridflow.reward import gsm8k, math_reward, reasoning_gym
from hybridflow.utils.imports import import_by_path

RewardFn = Callable[[str, str, str, dict], float]
REWARD_FN_PARAMETERS = ("data_source", "solution_str", "ground_truth", "extra_info")

# data_source -> fn(solution_str, ground_truth, format_score) -> float
RULE_SCORES: dict[str, Callable[..., float]] = {
    "openai/gsm8k": gsm8k.compute_score,
    "arith": gsm8k.compute_score,  # hybridflow.data.arith writes GSM8K-style "#### <number>" answers
    "shapes": gsm8k.compute_score,  # hybridflow.data.shapes (image prompts): "#### <count>" answers
    "math": math_reward.compute_score,  # scripts/prepare_math.py: \boxed{} answers, checked symbolically
}


def rule_for(data_source: str) -> Callable[..., float] | None:
    """The rule that scores `data_source`: RULE_SCORES', or for `reasoning_gym/<task>` rows
    (hybridflow/data/reasoning_gym.py) the task's own scorer; None when there is none."""
    if data_source.startswith(SOURCE_PREFIX):
        return reasoning_gym.compute_score
    return RULE_SCORES.get(data_source)


def rule_reward_fn(format_score: float = 0.0) -> RewardFn:
    """The built-in reward: the rule registered for each sample's data source."""

    def score(data_source: str, solution_str: str, ground_truth: str, extra_info: dict) -> float:
        rule = rule_for(data_source)
        if rule is None:
            raise ValueError(
                f"no reward rule for data_source {data_source!r} (known: {known_sources()}); "
                "set reward.custom_fn to a function 'module.fn' that scores it"
            )
        return rule(solution_str, ground_truth, format_score=format_score)

    return score


def known_sources() -> list[str]:
    """The data sources the rule reward scores, for error messages."""
    return [*sorted(RULE_SCORES), f"{SOURCE_PREFIX}<task>"]


def load_reward_fn(dotted_path: str) -> RewardFn:
    """Imports `package.module.fn` and checks it takes
    (data_source, solution_str, ground_truth, extra_info)."""
    fn = import_by_path(dotted_path, "reward.custom_fn", "package.module.function")
    names = tuple(inspect.signature(fn).parameters)[: len(REWARD_FN_PARAMETERS)]
    if names != REWARD_FN_PARAMETERS:
        raise TypeError(
            f"reward.custom_fn={dotted_path!r} takes {names}; a reward function must take "
            f"{REWARD_FN_PARAMETERS} and return a float"
        )
    return fn
