"""A user's reward function that raises, end to end (the tiny GRPO run of tests/tiny_run.py, in
process on this pytest worker's Ray cluster: tests/recipe_runs.py): main's status 1, the
function's own traceback once (its frames only, none of hybridflow's or Ray's), then one `error:`
line naming the function, the response, its data_source and what it raised. (Returning None / a
string: tests/test_reward.py, the same error.)"""

import pytest
from recipe_runs import run_recipe_in_process
from tiny_run import RECIPE, overrides, tiny_run_inputs

pytestmark = pytest.mark.slow

EXPLODING_REWARD = """
def explode(data_source, solution_str, ground_truth, extra_info):
    return parse(solution_str)


def parse(text):
    return 1 / 0
"""


@pytest.mark.usefixtures("ray_cluster")
def test_a_reward_function_that_raises_shows_its_own_traceback_once_and_one_error_line(tmp_path):
    local = tiny_run_inputs(tmp_path / "inputs")
    (local["root"] / "user_rewards.py").write_text(EXPLODING_REWARD)
    settings = overrides(
        local, tmp_path / "run", "trainer.total_training_steps=1", "reward.custom_fn=user_rewards.explode"
    )
    result = run_recipe_in_process(RECIPE, settings, pythonpath=local["root"])
    assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-3000:]
    err = result.stderr
    assert err.count("Traceback (most recent call last):") == 1, err[-3000:]
    user_traceback = err[err.index("Traceback (most recent call last):") :]
    frames = [line for line in user_traceback.splitlines() if line.startswith('  File "')]
    assert frames and all("user_rewards.py" in line for line in frames), user_traceback
    assert [line.split(", in ")[1] for line in frames] == ["explode", "parse"]
    assert err.rstrip().splitlines()[-1] == (
        "error: reward function user_rewards.explode on response 0 (data_source 'arith') raised "
        "ZeroDivisionError: division by zero"
    )
