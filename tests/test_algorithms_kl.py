"""KL estimators, KL coefficient controllers and the KL-in-reward penalty, by hand."""

import math

import pytest
import torch

from hybridflow.algorithms import AdaptiveKLController, FixedKLController, apply_kl_penalty, kl_penalty

LOG2 = math.log(2.0)


@pytest.mark.parametrize(
    ("kinds", "forward", "backward"),
    [
        # log r = log pi - log pi_ref = +log 2 (forward) or -log 2 (backward)
        (("kl", "k1"), LOG2, -LOG2),
        (("abs",), LOG2, LOG2),
        (("mse", "k2"), 0.5 * LOG2**2, 0.5 * LOG2**2),
        (("low_var_kl", "k3"), 0.5 - 1 + LOG2, 2 - 1 - LOG2),  # 1/r - 1 + log r
    ],
)
def test_kl_estimators_by_hand(kinds, forward, backward):
    half, quarter = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    for kind in kinds:
        assert kl_penalty(half, quarter, kind).item() == pytest.approx(forward, rel=1e-6)
        assert kl_penalty(quarter, half, kind).item() == pytest.approx(backward, rel=1e-6)


def test_low_var_kl_is_clamped_and_unknown_kind_rejected():
    assert kl_penalty(torch.tensor([-30.0]), torch.tensor([0.0]), "low_var_kl").item() == 10.0
    with pytest.raises(ValueError, match="KL penalty kind"):
        kl_penalty(torch.zeros(1), torch.zeros(1), "full")


def test_adaptive_controller_follows_ziegler_update():
    ctrl = AdaptiveKLController(value=0.1, target=6.0, horizon=10000)
    ctrl.update(current_kl=9.0, n_steps=100)  # error .5 clipped to .2 -> x(1 + .2 * 100 / 10000)
    assert ctrl.value == pytest.approx(0.1 * 1.002)
    ctrl.update(current_kl=6.6, n_steps=100)  # error .1 -> x1.001
    assert ctrl.value == pytest.approx(0.1 * 1.002 * 1.001)
    ctrl.update(current_kl=0.0, n_steps=100)  # error -1 clipped to -.2 -> x.998
    assert ctrl.value == pytest.approx(0.1 * 1.002 * 1.001 * 0.998)
    with pytest.raises(ValueError, match="must be positive"):
        AdaptiveKLController(value=0.1, target=0.0, horizon=1)


def test_apply_kl_penalty_by_hand():
    scores = torch.tensor([[0.0, 0.0, 1.0], [0.0, 1.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    ref = torch.zeros(2, 3)
    old = torch.tensor([[0.1, 0.2, 0.3], [0.4, 0.5, 9.0]])  # log r; the 9 is on padding
    ctrl = FixedKLController(value=0.5)
    rewards, metrics = apply_kl_penalty(scores, old, ref, mask, ctrl, kind="k1")
    torch.testing.assert_close(rewards, torch.tensor([[-0.05, -0.1, 0.85], [-0.2, 0.75, 0.0]]))
    assert metrics["reward_kl_penalty"] == pytest.approx((0.2 + 0.45) / 2)  # per-sequence means
    assert metrics["reward_kl_penalty_coeff"] == 0.5 and ctrl.value == 0.5

    adaptive = AdaptiveKLController(value=0.5, target=0.65, horizon=10)
    apply_kl_penalty(scores, old, ref, mask, adaptive, kind="k1")
    # KL .325 vs target .65: error -.5 clipped to -.2, over 2 sequences -> x(1 - .2 * 2 / 10)
    assert adaptive.value == pytest.approx(0.5 * 0.96)
