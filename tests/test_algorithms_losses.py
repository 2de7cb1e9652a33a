"""Loss aggregation, PPO policy loss and clipped value loss against hand-computed values."""

import math

import pytest
import torch

from hybridflow.algorithms import agg_loss, compute_policy_loss, compute_value_loss, masked_whiten
from hybridflow.algorithms.masked import compute_response_mask

LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
MASK = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])  # last sequence has no valid token


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", (1 + 2 + 4) / 3),
        ("seq-mean-token-sum", ((1 + 2) + 4) / 2),
        ("seq-mean-token-mean", ((1 + 2) / 2 + 4) / 2),
        ("seq-mean-token-sum-norm", ((1 + 2) / 3 + 4 / 3) / 2),  # T = 3 columns
    ],
)
def test_agg_loss_modes_and_global_counts(mode, expected):
    assert agg_loss(LOSS, MASK, mode).item() == pytest.approx(expected)
    # micro-batches normalised by the whole batch's counts (3 tokens, 2 sequences) add up
    parts = [agg_loss(LOSS[i : i + 1], MASK[i : i + 1], mode, 3, 2) for i in range(3)]
    assert sum(p.item() for p in parts) == pytest.approx(expected)


def test_agg_loss_rejects_unknown_mode():
    with pytest.raises(ValueError, match="loss_agg_mode must be one of"):
        agg_loss(LOSS, MASK, "sum")


# ratios 1.5, 0.5, 1.1, 5.0 against advantages +1, -1, -1, -1
RATIOS = torch.tensor([[1.5, 0.5, 1.1, 5.0]])
ADV = torch.tensor([[1.0, -1.0, -1.0, -1.0]])


def _policy_loss(mask, **kwargs):
    log_prob = RATIOS.log().requires_grad_(True)
    out = compute_policy_loss(torch.zeros_like(RATIOS), log_prob, ADV, mask, **kwargs)
    return log_prob, out


def test_ppo_clip_higher_and_dual_clip_by_hand():
    log_prob, (pg_loss, clipfrac, ppo_kl, clipfrac_lower) = _policy_loss(
        torch.ones(1, 4), clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0
    )
    # token 0: max(-1.5, -1.28) = -1.28 (upper clip); token 1: max(0.5, 0.8) = 0.8 (lower clip);
    # token 2: 1.1 (no clip); token 3: max(5, 1.28) = 5, dual clip min(5, 3) = 3
    assert pg_loss.item() == pytest.approx((-1.28 + 0.8 + 1.1 + 3.0) / 4)
    assert clipfrac.item() == pytest.approx(2 / 4)
    assert clipfrac_lower.item() == pytest.approx(1 / 4)
    assert ppo_kl.item() == pytest.approx(-math.log(1.5 * 0.5 * 1.1 * 5.0) / 4, rel=1e-6)
    pg_loss.backward()
    # only the unclipped token carries gradient: d(-A * r)/d(log r) / 4 = 1.1 / 4
    torch.testing.assert_close(log_prob.grad, torch.tensor([[0.0, 0.0, 1.1 / 4, 0.0]]))


def test_ppo_symmetric_clip_and_mask():
    _, (pg_loss, clipfrac, _, clipfrac_lower) = _policy_loss(
        torch.tensor([[1, 1, 1, 0]]), clip_ratio_low=0.2, clip_ratio_high=0.2
    )
    assert pg_loss.item() == pytest.approx((-1.2 + 0.8 + 1.1) / 3)
    assert clipfrac.item() == pytest.approx(2 / 3)
    assert clipfrac_lower.item() == 0.0
    _, (seq_sum, *_) = _policy_loss(torch.ones(1, 4), loss_agg_mode="seq-mean-token-sum")
    assert seq_sum.item() == pytest.approx(-1.2 + 0.8 + 1.1 + 3.0)


def test_ppo_rejects_dual_clip_bound_not_above_one():
    with pytest.raises(ValueError, match="clip_ratio_c"):
        _policy_loss(torch.ones(1, 4), clip_ratio_c=1.0)


def test_clipped_value_loss_by_hand():
    vpreds = torch.tensor([[1.0, 1.0, 2.0]])
    old_values = torch.tensor([[0.5, 0.5, 2.0]])
    returns = torch.tensor([[0.0, 2.0, 3.0]])
    vf_loss, vf_clipfrac = compute_value_loss(vpreds, old_values, returns, torch.ones(1, 3), 0.2)
    # clipped predictions .7, .7, 2: token 0 max(1, .49) = 1; token 1 max(1, 1.69) = 1.69; token 2: 1
    assert vf_loss.item() == pytest.approx(0.5 * (1 + 1.69 + 1) / 3)
    assert vf_clipfrac.item() == pytest.approx(1 / 3)


def test_whiten_single_token_and_response_mask():
    assert masked_whiten(torch.tensor([[5.0, 9.0]]), torch.tensor([[1, 0]]))[0, 0].item() == 0.0
    attention_mask = torch.tensor([[0, 1, 1, 1, 0]])  # left-padded prompt of 3, response of 2
    assert compute_response_mask(torch.zeros(1, 2), attention_mask).tolist() == [[1, 0]]
