"""Advantage estimators against values worked out by hand (comments show the arithmetic)."""

import statistics

import pytest
import torch

from hybridflow.algorithms import (
    compute_advantage,
    gae,
    grpo,
    reinforce_plus_plus,
    reinforce_plus_plus_baseline,
    remax,
    rloo,
)


def _whiten_by_hand(valid: list[float]) -> list[float]:
    mean, std = statistics.mean(valid), statistics.stdev(valid)  # stdev has Bessel's correction
    return [(v - mean) / std for v in valid]


def _t(rows):
    return torch.tensor(rows, dtype=torch.float32)


def test_gae_hand_computed_with_padding_not_leaking():
    rewards = _t([[0, 0, 1], [0, 1, 0]])
    values = _t([[1, 2, 3], [1, 2, 99]])  # 99 sits on padding and must not enter any delta
    mask = _t([[1, 1, 1], [1, 1, 0]])
    advantages, returns = gae(rewards, values, mask, gamma=0.5, lam=0.5)
    # row 0: d2 = 1 - 3 = -2 -> A2 = -2; d1 = 0 + .5*3 - 2 = -.5 -> A1 = -.5 + .25*-2 = -1;
    #        d0 = 0 + .5*2 - 1 = 0 -> A0 = .25*-1 = -.25
    # row 1: t=2 is padding; d1 = 1 - 2 = -1 -> A1 = -1; d0 = .5*2 - 1 = 0 -> A0 = -.25
    raw = [-0.25, -1.0, -2.0, -0.25, -1.0]
    torch.testing.assert_close(returns, _t([[0.75, 1.0, 1.0], [0.75, 1.0, 0.0]]))
    w = _whiten_by_hand(raw)
    torch.testing.assert_close(advantages, _t([[w[0], w[1], w[2]], [w[3], w[4], 0.0]]), atol=1e-5, rtol=1e-5)


def test_gae_skips_a_masked_token_inside_the_response():
    rewards, values, mask = _t([[0, 5, 1]]), _t([[1, 7, 3]]), _t([[1, 0, 1]])
    _, returns = gae(rewards, values, mask, gamma=0.5, lam=0.5)
    # A2 = 1 - 3 = -2; t=1 skipped; d0 = 0 + .5*3 - 1 = .5 -> A0 = .5 + .25*-2 = 0
    torch.testing.assert_close(returns, _t([[1.0, 0.0, 1.0]]))


GROUPS = ["a", "a", "b", "b", "b", "c"]
SCORES_BY_TOKEN = [[0, 1], [0, 0], [1, 1], [0, 0], [0, 1], [3, 0]]  # scores 1, 0, 2, 0, 1, 3


def test_grpo_with_std_normalisation():
    rewards = _t(SCORES_BY_TOKEN)
    mask = torch.ones(6, 2)
    mask[5, 1] = 0  # response c is one token long: its advantage covers only that token
    advantages, returns = grpo(rewards, mask, GROUPS)
    # a: scores 1, 0 -> mean .5, std sqrt(.5); b: 2, 0, 1 -> mean 1, std 1; c: single -> A = score
    eps = 1e-6
    a = 0.5 / (0.5**0.5 + eps)
    b = 1.0 / (1.0 + eps)
    expected = [a, -a, b, -b, 0.0, 3.0]
    torch.testing.assert_close(advantages[:, 0], _t(expected))
    torch.testing.assert_close(advantages[:, 1], _t([*expected[:5], 0.0]))
    assert torch.equal(advantages, returns)


def test_grpo_without_std_and_epsilon():
    advantages, _ = grpo(_t(SCORES_BY_TOKEN), torch.ones(6, 2), GROUPS, norm_adv_by_std=False)
    torch.testing.assert_close(advantages[:, 0], _t([0.5, -0.5, 1.0, -1.0, 0.0, 3.0]))
    equal_scores, _ = grpo(_t([[1.0], [1.0]]), torch.ones(2, 1), ["g", "g"], epsilon=1e-6)
    torch.testing.assert_close(equal_scores, torch.zeros(2, 1))  # std 0: epsilon keeps it finite


def test_rloo_leave_one_out_baseline():
    advantages, _ = rloo(_t(SCORES_BY_TOKEN), torch.ones(6, 2), GROUPS)
    # a: 1-0, 0-1; b: 2-(0+1)/2, 0-(2+1)/2, 1-(2+0)/2; c: single, no baseline
    torch.testing.assert_close(advantages[:, 0], _t([1.0, -1.0, 1.5, -1.5, 0.0, 3.0]))


def test_index_length_must_match_batch():
    with pytest.raises(ValueError, match="index has 2 entries"):
        rloo(_t(SCORES_BY_TOKEN), torch.ones(6, 2), ["a", "b"])


def test_reinforce_plus_plus_discounted_then_whitened():
    rewards = _t([[1, 0, 2], [0, 3, 10]])  # the 10 sits on padding and is ignored
    mask = _t([[1, 1, 1], [1, 1, 0]])
    advantages, returns = reinforce_plus_plus(rewards, mask, gamma=0.5)
    # row 0: G2 = 2, G1 = 0 + .5*2 = 1, G0 = 1 + .5*1 = 1.5; row 1: G1 = 3, G0 = .5*3 = 1.5
    torch.testing.assert_close(returns, _t([[1.5, 1.0, 2.0], [1.5, 3.0, 0.0]]))
    w = _whiten_by_hand([1.5, 1.0, 2.0, 1.5, 3.0])
    torch.testing.assert_close(advantages, _t([w[:3], [w[3], w[4], 0.0]]), atol=1e-5, rtol=1e-5)


def test_reinforce_plus_plus_baseline_group_mean_then_whiten():
    rewards = _t([[0, 1], [0, 0], [5, 0]])
    mask = _t([[1, 1], [1, 1], [1, 0]])
    advantages, _ = reinforce_plus_plus_baseline(rewards, mask, ["a", "a", "b"])
    # a: 1 - .5, 0 - .5 on both tokens; b: single, 5 on its one token
    w = _whiten_by_hand([0.5, 0.5, -0.5, -0.5, 5.0])
    torch.testing.assert_close(advantages, _t([w[0:2], w[2:4], [w[4], 0.0]]), atol=1e-5, rtol=1e-5)


def test_remax_subtracts_greedy_baseline():
    advantages, returns = remax(_t([[0, 1, 2]]), _t([[1, 1, 0]]), reward_baselines=_t([0.5]))
    torch.testing.assert_close(returns, _t([[1.0, 1.0, 0.0]]))  # reward-to-go over valid tokens
    torch.testing.assert_close(advantages, _t([[0.5, 0.5, 0.0]]))


def test_compute_advantage_picks_by_name_and_checks_inputs():
    rewards, mask = _t(SCORES_BY_TOKEN), torch.ones(6, 2)
    by_name, _ = compute_advantage("rloo", rewards, mask, index=GROUPS)
    torch.testing.assert_close(by_name, rloo(rewards, mask, GROUPS)[0])
    with pytest.raises(ValueError, match="needs \\['values'\\]"):
        compute_advantage("gae", rewards, mask)
    with pytest.raises(ValueError, match="unknown advantage estimator 'ppo'"):
        compute_advantage("ppo", rewards, mask)
