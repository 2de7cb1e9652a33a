"""grpo_passk, opo, gpg, gdpo and the optimal token baseline against values worked out by hand from
each paper's formula (the comments show the arithmetic), and a user's estimator by dotted path:
loaded, its signature and its outputs checked."""

import math
import sys

import pytest
import torch

from hybridflow.algorithms import compute_advantage
from hybridflow.algorithms.advantages import (
    ADVANTAGE_PARAMETERS,
    advantage_estimator_fn,
    gdpo,
    gdpo_advantages,
    gpg,
    grpo_passk,
    opo,
    optimal_token_baseline,
)
from hybridflow.utils.imports import DottedPathError

EPS = 1e-6


def _t(rows):
    return torch.tensor(rows, dtype=torch.float32)


def _per_response(advantages: torch.Tensor) -> list[float]:
    return advantages[:, 0].tolist()


def test_grpo_passk_one_right_of_four_at_k_2():
    # scores 1, 0, 0, 0 (the 1 on a response's last token); the last response is one token long
    rewards = _t([[0, 1], [0, 0], [0, 0], [0, 0]])
    mask = _t([[1, 1], [1, 1], [1, 1], [1, 0]])
    advantages, returns = grpo_passk(rewards, mask, ["a"] * 4, k=2)
    # n = 4, c = 1: R = 1 - C(3,2)/C(4,2) = 1 - 3/6 = 1/2, sigma = sqrt(1/2 * 1/2) = 1/2
    # right: (1 - 1/2) / (1/2 + eps)
    # wrong: C(2,1)/C(3,1) = 2/3 -> (1 - 1/2 - 2/3) / (1/2 + eps) = (-1/6) / (1/2 + eps)
    right, wrong = 0.5 / (0.5 + EPS), (-1 / 6) / (0.5 + EPS)
    expected = _t([[right, right], [wrong, wrong], [wrong, wrong], [wrong, 0.0]])
    torch.testing.assert_close(advantages, expected)
    torch.testing.assert_close(returns, expected)


def test_grpo_passk_one_right_of_three_at_k_2():
    rewards, mask = _t([[1], [0], [0]]), torch.ones(3, 1)
    advantages, _ = grpo_passk(rewards, mask, ["a"] * 3, k=2)
    # n = 3, c = 1: R = 1 - C(2,2)/C(3,2) = 2/3, sigma = sqrt(2/3 * 1/3) = sqrt(2)/3
    # right: (1/3) / sigma = 1/sqrt(2); wrong: C(1,1)/C(2,1) = 1/2 -> (1/3 - 1/2) / sigma = -1/(2 sqrt(2))
    sigma = math.sqrt(2) / 3
    expected = [(1 / 3) / (sigma + EPS), (-1 / 6) / (sigma + EPS), (-1 / 6) / (sigma + EPS)]
    assert _per_response(advantages) == pytest.approx(expected, rel=1e-6)
    assert expected[0] == pytest.approx(1 / math.sqrt(2), rel=1e-5)


def test_grpo_passk_gives_zero_where_every_k_subset_passes_or_none_does():
    # n = 3, c = 2, k = 2: every pair holds a right response (C(1,2) = 0): R = 1, sigma = 0; the wrong
    # response's companions always pass (C(0,1)/C(2,1) = 0): (1 - 1 - 0) / eps = 0
    # second group: all wrong: R = 0, sigma = 0, wrong: (1 - 0 - C(2,1)/C(2,1)) / eps = 0
    rewards, mask = _t([[1], [1], [0], [0], [0], [0]]), torch.ones(6, 1)
    advantages, _ = grpo_passk(rewards, mask, ["a", "a", "a", "b", "b", "b"], k=2)
    assert _per_response(advantages) == [0.0] * 6


def test_grpo_passk_at_k_1_is_grpo_with_the_population_std():
    rewards, mask = _t([[1], [0], [0], [0]]), torch.ones(4, 1)
    advantages, _ = grpo_passk(rewards, mask, ["a"] * 4, k=1)
    # R = 1 - C(3,1)/C(4,1) = 1/4, sigma = sqrt(1/4 * 3/4) = sqrt(3)/4
    # right: (3/4) / sigma = sqrt(3); wrong: C(2,0)/C(3,0) = 1 -> (1 - 1/4 - 1) / sigma = -1/sqrt(3)
    assert _per_response(advantages) == pytest.approx([math.sqrt(3)] + [-1 / math.sqrt(3)] * 3, rel=1e-5)


def test_grpo_passk_refuses_a_score_that_is_neither_0_nor_1_and_a_group_smaller_than_k():
    mask = torch.ones(2, 1)
    with pytest.raises(ValueError, match=r"adv_estimator=grpo_passk needs outcome rewards of 0 or 1.*0\.5"):
        grpo_passk(_t([[0.5], [1]]), mask, ["a", "a"], k=2)
    with pytest.raises(ValueError, match="k=3 got a group of 2 responses"):
        grpo_passk(_t([[0], [1]]), mask, ["a", "a"], k=3)


def test_opo_weighs_each_score_by_its_response_length():
    # group a: scores 1, 0, 1 of lengths 3, 1, 2; group b: one response (no baseline)
    rewards = _t([[0, 0, 1], [0, 0, 0], [0, 1, 0], [0, 0, 2]])
    mask = _t([[1, 1, 1], [1, 0, 0], [1, 1, 0], [1, 1, 1]])
    advantages, returns = opo(rewards, mask, ["a", "a", "a", "b"])
    # b = (3*1 + 1*0 + 2*1) / (3 + 1 + 2) = 5/6 (the plain mean would be 2/3): A = 1/6, -5/6, 1/6
    expected = _t([[1 / 6] * 3, [-5 / 6, 0, 0], [1 / 6, 1 / 6, 0], [2, 2, 2]])
    torch.testing.assert_close(advantages, expected)
    torch.testing.assert_close(returns, expected)


def test_the_optimal_token_baseline_weighs_each_return_by_the_gradient_norm_so_far():
    # group a: response 1 scores 1 (3 tokens), response 2 scores 0 (2 tokens); group b: one response
    rewards = _t([[0, 0, 1], [0, 0, 0], [0, 2, 0]])
    mask = _t([[1, 1, 1], [1, 1, 0], [1, 1, 0]])
    pi = _t([[1 / 2, 1 / 2, 1 / 2], [1 / 4, 1 / 2, 1], [1 / 2, 1 / 2, 1]])  # the sampled tokens'
    squares = _t([[1 / 2, 1 / 2, 1 / 2], [1 / 4, 1 / 2, 1], [1 / 2, 1 / 2, 1]])  # sum_v pi_v^2
    advantages, returns = optimal_token_baseline(rewards, mask, ["a", "a", "b"], pi.log(), squares)
    # w = 1 - 2 pi + sum pi^2: row 1: 1 - 1 + 1/2 = 1/2 each -> W = 1/2, 1, 3/2
    #                          row 2: 1 - 1/2 + 1/4 = 3/4, then 1 - 1 + 1/2 = 1/2 -> W = 3/4, 5/4
    # G: row 1 = 1, 1, 1; row 2 = 0, 0
    # b_1 = (1/2 * 1 + 3/4 * 0) / (1/2 + 3/4) = 2/5; b_2 = (1 * 1 + 5/4 * 0) / (1 + 5/4) = 4/9;
    # b_3 = (3/2 * 1) / (3/2) = 1 (row 1 alone); group b has no baseline: A = G = 2, 2
    expected = _t([[1 - 2 / 5, 1 - 4 / 9, 0], [-2 / 5, -4 / 9, 0], [2, 2, 0]])
    torch.testing.assert_close(advantages, expected)
    torch.testing.assert_close(returns, _t([[1, 1, 1], [0, 0, 0], [2, 2, 0]]))


def test_the_optimal_token_baseline_with_equal_weights_is_the_group_mean_and_zero_without_gradient():
    rewards, mask = _t([[0, 3], [0, 1], [0, 5], [0, 1]]), torch.ones(4, 2)
    # group a: every token pi = 1/2, sum pi^2 = 1/2: w = 1/2 for both rows -> b = mean(3, 1) = 2
    # group b: every token pi = 1, sum pi^2 = 1: w = 1 - 2 + 1 = 0 (no gradient) -> b = 0, A = G
    pi = _t([[1 / 2, 1 / 2], [1 / 2, 1 / 2], [1, 1], [1, 1]])
    advantages, _ = optimal_token_baseline(rewards, mask, ["a", "a", "b", "b"], pi.log(), pi)
    torch.testing.assert_close(advantages, _t([[1, 1], [-1, -1], [5, 5], [1, 1]]))


def test_the_optimal_token_baseline_by_name_needs_sum_pi_squared():
    rewards, mask, old = _t([[1], [0]]), torch.ones(2, 1), torch.zeros(2, 1)
    with pytest.raises(ValueError, match=r"'optimal_token_baseline' needs \['sum_pi_squared'\]"):
        compute_advantage("optimal_token_baseline", rewards, mask, index=["a", "a"], old_log_probs=old)
    # pi = 1 everywhere: w = 0, no baseline, A = G
    advantages, _ = compute_advantage(
        "optimal_token_baseline", rewards, mask, index=["a", "a"], old_log_probs=old, sum_pi_squared=old.exp()
    )
    torch.testing.assert_close(advantages, _t([[1], [0]]))


def test_gpg_centres_in_the_group_and_scales_by_the_share_of_varied_responses():
    # group a: 1, 0 (varied); group b: 1, 1, 1 (alike: advantage 0)
    rewards, mask = _t([[1], [0], [1], [1], [1]]), torch.ones(5, 1)
    advantages, _ = gpg(rewards, mask, ["a", "a", "b", "b", "b"])
    # B = 5, M = 3: alpha = 5 / (5 - 3) = 2.5; a: mean 1/2 -> 2.5 * (+-1/2) = +-1.25 (no std division)
    assert _per_response(advantages) == [1.25, -1.25, 0.0, 0.0, 0.0]


def test_gpg_with_every_group_alike_is_all_zero():
    advantages, _ = gpg(_t([[1], [1], [0], [0]]), torch.ones(4, 1), ["a", "a", "b", "b"])
    assert _per_response(advantages) == [0.0] * 4


def test_gdpo_normalises_each_reward_component_in_its_group_before_summing():
    # two groups of two, two components each; GRPO on the summed rewards (2, 0) and (1, 0) would give
    # both groups +-1/sqrt(2): the same advantage for a response right on both counts as on one
    components = _t([[1, 1], [0, 0], [1, 0], [0, 0]])
    summed = gdpo_advantages(components, ["a", "a", "b", "b"])
    # a: each component (1, 0): mean 1/2, unbiased std 1/sqrt(2) -> +-1/sqrt(2) each -> sum +-sqrt(2)
    # b: first (1, 0) -> +-1/sqrt(2); second (0, 0): std 0 -> 0 -> sum +-1/sqrt(2)
    # batch: (sqrt2, -sqrt2, 1/sqrt2, -1/sqrt2), mean 0, unbiased var (2 + 2 + 1/2 + 1/2) / 3 = 5/3
    s = 1 / math.sqrt(2)
    half = s / (s + EPS)  # a component's group normalisation with eps
    raw = [2 * half, -2 * half, half, -half]
    std = math.sqrt(sum(v * v for v in raw) / 3)
    assert summed.tolist() == pytest.approx([v / (std + EPS) for v in raw], rel=1e-5)
    # = (2, -2, 1, -1) / sqrt(10/3)
    assert summed.tolist() == pytest.approx([v / math.sqrt(10 / 3) for v in (2, -2, 1, -1)], rel=1e-4)


def test_gdpo_on_one_reward_is_group_normalisation_then_batch_whitening():
    # scores 1, 0 | 2, 1 over two-token responses; the last is one token long
    rewards = _t([[0, 1], [0, 0], [1, 1], [1, 0]])
    mask = _t([[1, 1], [1, 1], [1, 1], [1, 0]])
    advantages, returns = gdpo(rewards, mask, ["a", "a", "b", "b"])
    # each group: +-1/2 around its mean over an unbiased std of 1/sqrt(2) -> +-1/sqrt(2);
    # over the batch: mean 0, unbiased std sqrt(4 * 1/2 / 3) = sqrt(2/3)
    # -> +-(1/sqrt2) / sqrt(2/3) = +-sqrt(3)/2
    a = math.sqrt(3) / 2
    expected = _t([[a, a], [-a, -a], [a, a], [-a, 0]])
    torch.testing.assert_close(advantages, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(returns, expected, atol=1e-5, rtol=1e-5)


def test_the_registry_runs_each_new_estimator_by_name_with_what_it_needs():
    rewards, mask, index = _t([[1], [0], [0], [1]]), torch.ones(4, 1), ["a", "a", "b", "b"]
    for name in ("opo", "gpg", "gdpo"):
        advantages, _ = compute_advantage(name, rewards, mask, index=index)
        assert advantages.shape == (4, 1)
    with pytest.raises(ValueError, match=r"'grpo_passk' needs \['k'\]"):
        compute_advantage("grpo_passk", rewards, mask, index=index)
    advantages, _ = compute_advantage("grpo_passk", rewards, mask, index=index, k=2)
    # each group n = 2, c = 1, k = 2: R = 1, sigma = 0: every pair passes -> 0
    assert _per_response(advantages) == [0.0] * 4


USER_ESTIMATORS = """
def scaled_scores(token_level_rewards, response_mask, index, batch, config):
    advantages = token_level_rewards.sum(-1, keepdim=True) * response_mask * config["scale"] + batch["shift"]
    return advantages, advantages


def wrong_signature(token_level_rewards, response_mask):
    return token_level_rewards, token_level_rewards


def one_output(token_level_rewards, response_mask, index, batch, config):
    return token_level_rewards
"""


@pytest.fixture
def user_estimators(tmp_path, monkeypatch):
    (tmp_path / "user_estimators.py").write_text(USER_ESTIMATORS)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "user_estimators"
    sys.modules.pop("user_estimators", None)  # another test's file of the same name imports afresh


def test_a_users_estimator_runs_by_dotted_path_with_the_batch_and_config(user_estimators):
    rewards, mask = _t([[0, 2], [1, 0]]), _t([[1, 1], [1, 0]])
    batch = {"shift": _t([[0.5, 0.5], [0.5, 0.5]])}
    advantages, _ = compute_advantage(
        f"{user_estimators}.scaled_scores", rewards, mask, index=["a", "b"], batch=batch, config={"scale": 3}
    )
    # scores 2, 1 times 3, on valid tokens, plus 0.5 everywhere
    torch.testing.assert_close(advantages, _t([[6.5, 6.5], [3.5, 0.5]]))


def test_a_users_estimator_of_another_signature_is_refused_naming_key_and_parameters(user_estimators):
    with pytest.raises(ValueError) as err:
        advantage_estimator_fn(f"{user_estimators}.wrong_signature")
    message = str(err.value)
    assert "algorithm.adv_estimator='user_estimators.wrong_signature'" in message
    assert "wrong_signature takes ('token_level_rewards', 'response_mask')" in message
    assert str(ADVANTAGE_PARAMETERS) in message


def test_a_users_estimator_returning_one_tensor_is_refused(user_estimators):
    with pytest.raises(ValueError, match=r"'user_estimators.one_output' must return \(advantages, returns\)"):
        compute_advantage(f"{user_estimators}.one_output", _t([[1]]), _t([[1]]), index=["a"])


def test_an_unknown_name_or_module_is_refused_naming_the_key():
    with pytest.raises(ValueError, match=r"unknown advantage estimator 'grpo2' \(algorithm.adv_estimator\)"):
        advantage_estimator_fn("grpo2")
    with pytest.raises(
        DottedPathError, match=r"algorithm.adv_estimator='no_such_module.fn' cannot be imported"
    ):
        advantage_estimator_fn("no_such_module.fn")
