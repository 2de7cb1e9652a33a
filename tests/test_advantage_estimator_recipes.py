"""Each advantage estimator added beside GRPO (grpo_passk, opo, gpg, gdpo, optimal_token_baseline)
trains two steps of the tiny model through the whole loop (Ray workers, the Megatron actor, the
transformers rollout; the optimal token baseline's sum_pi_squared comes from the actor's log-prob
pass, and the step fails without it), and so does a user's estimator from a file, named by dotted
path; one of the wrong signature is refused before Ray starts. The runs take
tests/two_grpo_steps.py's small recipe."""

import pytest
from entry_point_checks import RayStarted
from recipe_runs import run_recipe_in_process
from two_grpo_steps import small_run, trained_steps

from hybridflow.algorithms.advantages import ADVANTAGE_PARAMETERS
from hybridflow.trainer import main as entry

# 0 and 1 in turn: responses are scored in row order with a prompt's n responses side by side, so a
# group of an even n holds as many 1s as 0s and every estimator gives nonzero advantages (a group
# scored alike gives none, and no gradient); 0 / 1 outcomes are what grpo_passk scores
ALTERNATING_REWARD = """
import itertools

_calls = itertools.count()


def alternating(data_source, solution_str, ground_truth, extra_info):
    return float(next(_calls) % 2)
"""

USER_ESTIMATORS = """
def constant(token_level_rewards, response_mask, index, batch, config):
    assert "old_log_probs" in batch and config.adv_estimator == "user_estimators.constant"
    advantages = 0.375 * response_mask.float()  # a mean advantage no built-in estimator gives
    return advantages, advantages


def wrong_signature(token_level_rewards, response_mask):
    return token_level_rewards, token_level_rewards
"""

# what an estimator needs besides its name
# 2 prompts x 4 responses (the same 8 per step): with n = k = 2 every pair holding a 1 passes, so pass@2's
# advantages would all be 0
NEEDS = {"grpo_passk": ["algorithm.pass_k=2", "rollout.sampling.n=4", "data.train_batch_size=2"]}


@pytest.fixture(scope="module")
def local(gsm8k_local) -> dict:
    """The tiny GSM8K inputs with the alternating reward and the user's estimators on the runs' path."""
    (gsm8k_local["root"] / "alternating_reward.py").write_text(ALTERNATING_REWARD)
    (gsm8k_local["root"] / "user_estimators.py").write_text(USER_ESTIMATORS)
    return gsm8k_local


def run(local: dict, out, *overrides: str):
    argv = [*small_run(local, out), "reward.custom_fn=alternating_reward.alternating", *overrides]
    return run_recipe_in_process("recipes/gsm8k_grpo.yaml", argv, pythonpath=local["root"])


@pytest.mark.slow
@pytest.mark.parametrize("estimator", ["grpo_passk", "opo", "gpg", "gdpo", "optimal_token_baseline"])
def test_an_estimator_trains_two_steps(estimator, local, tmp_path):
    result = run(local, tmp_path, f"algorithm.adv_estimator={estimator}", *NEEDS.get(estimator, []))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    trained_steps(tmp_path)


@pytest.mark.slow
def test_a_users_estimator_from_a_file_trains_two_steps(local, tmp_path):
    """The estimator runs on the driver, so an in-process run imports it from the runs' path."""
    result = run(local, tmp_path, "algorithm.adv_estimator=user_estimators.constant")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    # the mean advantage only the user's function gives: it computed the advantages
    assert all(r["advantages/mean"] == pytest.approx(0.375) for r in trained_steps(tmp_path))


REFUSED = {
    "wrong_signature": (
        ["algorithm.adv_estimator=user_estimators.wrong_signature"],
        f"algorithm.adv_estimator='user_estimators.wrong_signature': wrong_signature takes "
        f"('token_level_rewards', 'response_mask'); an advantage estimator must take {ADVANTAGE_PARAMETERS}",
    ),
    "passk_without_k": (
        ["algorithm.adv_estimator=grpo_passk"],
        "algorithm.adv_estimator=grpo_passk needs algorithm.pass_k, the k of pass@k, between 1 and "
        "rollout.sampling.n=2; got None",
    ),
    "passk_k_above_n": (["algorithm.adv_estimator=grpo_passk", "algorithm.pass_k=3"], "n=2; got 3"),
    "k_without_passk": (["algorithm.pass_k=2"], "pass_k=2 is read by adv_estimator=grpo_passk only"),
    "token_baseline_of_one_response": (
        ["algorithm.adv_estimator=optimal_token_baseline", "rollout.sampling.n=1"],
        "algorithm.adv_estimator=optimal_token_baseline compares responses to the same prompt: set "
        "rollout.sampling.n >= 2",
    ),
    "passk_with_kl_in_reward": (
        ["algorithm.adv_estimator=grpo_passk", "algorithm.pass_k=2", "algorithm.use_kl_in_reward=true"],
        "grpo_passk scores 0 / 1 outcomes, and algorithm.use_kl_in_reward=true adds to them",
    ),
}


@pytest.mark.parametrize("case", REFUSED)
def test_a_recipe_the_estimator_cannot_run_is_refused_before_ray(case, local, tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise RayStarted("the checks passed and the entry point went on to start Ray")

    monkeypatch.setattr(entry, "connect_ray", refuse)
    overrides, message = REFUSED[case]
    result = run(local, tmp_path, *overrides)
    assert result.returncode == 2, result.stdout[-3000:] + result.stderr[-6000:]
    assert message in result.stderr and "Traceback" not in result.stderr, result.stderr
