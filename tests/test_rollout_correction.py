"""algorithm.rollout_correction's new parts against values worked out by hand: sequence-level
truncation, IcePop's and KPop's token masks, rejection sampling of whole sequences, the effective
sample size and the metrics of the parts together, the gradient they leave, and the settings
refused by name. Truncated / masked IS per token and decoupled PPO: tests/test_algorithms_offpolicy.py."""

import math

import pytest
import torch

from hybridflow.algorithms import compute_policy_loss
from hybridflow.algorithms.offpolicy import truncated_is_weights
from hybridflow.algorithms.rollout_correction import (
    RolloutCorrectionConfig,
    active_parts,
    binary_kl,
    effective_sample_size,
    icepop_token_mask,
    kpop_token_mask,
    rollout_correction_weights,
    sequence_acceptance,
    validate_rollout_correction,
)
from hybridflow.checks.algorithm import _rollout_correction_settings_unread
from hybridflow.config.schema import RecipeConfig

ROLLOUT = torch.full((2, 3), -1.0)  # (B, R) the engine's log-probs of the sampled tokens
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])  # (B, R) the last token of row 1 is padding


def old_with_ratios(ratios: list[list[float]]) -> torch.Tensor:
    """Actor log-probs whose ratio pi_old / mu to ROLLOUT is `ratios`. (B, R)"""
    return ROLLOUT + torch.tensor(ratios).log()


def test_sequence_truncation_caps_the_product_over_valid_tokens():
    # row 0: 2 * 2 * 1 = 4, capped at 3 on every token; row 1: 2 * 0.5 = 1 (the padding's 100 ignored)
    old = old_with_ratios([[2.0, 2.0, 1.0], [2.0, 0.5, 100.0]])
    expected = torch.tensor([[3.0, 3.0, 3.0], [1.0, 1.0, 1.0]])
    torch.testing.assert_close(truncated_is_weights(old, ROLLOUT, 3.0, MASK, "sequence"), expected)
    # per token the same ratios give min(rho_t, 3)
    torch.testing.assert_close(
        truncated_is_weights(old, ROLLOUT, 3.0), torch.tensor([[2.0, 2.0, 1.0], [2.0, 0.5, 3.0]])
    )


def test_icepop_keeps_tokens_whose_ratio_lies_in_the_band():
    old = old_with_ratios([[0.25, 1.0, 4.0], [0.5, 5.0, 6.0]])
    expected = torch.tensor([[False, True, True], [True, True, False]])  # 0.25 < 0.5, 6 > 5; bounds kept
    torch.testing.assert_close(icepop_token_mask(old, ROLLOUT, 0.5, 5.0), expected)


def test_binary_kl_by_hand():
    p, q = torch.tensor([0.5]), torch.tensor([0.25])
    # 0.5 ln(0.5 / 0.25) + 0.5 ln(0.5 / 0.75) = 0.5 * 0.693147 - 0.5 * 0.405465 = 0.143841
    assert binary_kl(p.log(), q.log()).item() == pytest.approx(0.143841, abs=1e-6)
    # 0.25 ln(0.25 / 0.5) + 0.75 ln(0.75 / 0.5) = -0.173287 + 0.304099 = 0.130812
    assert binary_kl(q.log(), p.log()).item() == pytest.approx(0.130812, abs=1e-6)


@pytest.mark.parametrize(
    ("threshold", "kept"),
    [(0.1, False), (0.14, False), (0.144, True)],  # the larger direction, 0.143841, decides
)
def test_kpop_masks_a_token_when_either_direction_exceeds_the_threshold(threshold, kept):
    half, quarter = torch.tensor([[0.5]]).log(), torch.tensor([[0.25]]).log()
    assert kpop_token_mask(half, quarter, threshold).item() is kept  # D(pi_old || mu) = 0.1438
    assert kpop_token_mask(quarter, half, threshold).item() is kept  # D(mu || pi_old) = 0.1438
    assert kpop_token_mask(half, half, 1e-9).item()  # equal probabilities: binary KL 0


def test_rejection_reads_the_sequence_ratio_or_its_geometric_mean_over_valid_tokens():
    old = old_with_ratios([[2.0, 2.0, 1.0], [2.0, 0.5, 100.0]])
    # products 4 and 1 (padding ignored): row 0 leaves [0.5, 2]
    accepted = sequence_acceptance(old, ROLLOUT, MASK, "sequence", 0.5, 2.0)
    torch.testing.assert_close(accepted, torch.tensor([[False], [True]]))
    # geometric means (2 * 2 * 1)^(1/3) = 1.587 and (2 * 2)^(1/2) = 2 (two valid tokens, not three)
    old = old_with_ratios([[2.0, 2.0, 1.0], [2.0, 2.0, 100.0]])
    geometric = sequence_acceptance(old, ROLLOUT, MASK, "geometric", None, 1.6)
    torch.testing.assert_close(geometric, torch.tensor([[True], [False]]))
    wider = sequence_acceptance(old, ROLLOUT, MASK, "geometric", None, 2.0)
    torch.testing.assert_close(wider, torch.tensor([[True], [True]]))
    low = sequence_acceptance(
        old_with_ratios([[0.5, 0.5, 0.5], [1, 1, 1]]), ROLLOUT, MASK, "geometric", 0.6, None
    )
    torch.testing.assert_close(low, torch.tensor([[False], [True]]))  # geometric mean 0.5 < 0.6


def test_effective_sample_size_is_normalised_by_the_valid_tokens():
    weights = torch.tensor([[1.0, 1.0, 0.0], [2.0, 0.0, 9.0]])  # the padding's 9 ignored
    # (1 + 1 + 0 + 2 + 0)^2 / (5 * (1 + 1 + 0 + 4 + 0)) = 16 / 30
    assert effective_sample_size(weights, MASK) == pytest.approx(16 / 30)
    assert effective_sample_size(torch.full((2, 3), 0.7), MASK) == pytest.approx(1.0)
    assert effective_sample_size(torch.zeros(2, 3), MASK) == 0.0


def test_the_parts_multiply_and_their_metrics_count_by_hand():
    """truncated_is (C 2) x icepop [0.5, 5] x rejection of products above 3.
    row 0, rho 0.25, 1, 4: truncated 0.25, 1, 2; icepop drops 0.25; product 1 accepted -> 0, 1, 2.
    row 1, rho 2, 3 (+ padding): truncated 2, 2; product 6 > 3 rejected -> 0, 0."""
    old = old_with_ratios([[0.25, 1.0, 4.0], [2.0, 3.0, 9.0]])
    cfg = RolloutCorrectionConfig(mode="truncated_is", upper=2.0, token_mask="icepop", rejection="sequence")
    cfg.rejection_upper = 3.0
    weights, metrics = rollout_correction_weights(cfg, old, ROLLOUT, MASK)
    torch.testing.assert_close(weights * MASK, torch.tensor([[0.0, 1.0, 2.0], [0.0, 0.0, 0.0]]))
    assert metrics == pytest.approx(
        {
            "is_weight_mean": 3 / 5,  # (0 + 1 + 2 + 0 + 0) / 5
            "is_weight_max": 2.0,
            "is_clipped_frac": 2 / 5,  # 4 -> 2 and 3 -> 2
            "is_masked_frac": 3 / 5,  # 0.25 (icepop) and row 1 (rejected)
            "is_ess": 9 / 25,  # (0 + 1 + 2)^2 / (5 * (1 + 4))
            "token_mask_frac": 1 / 5,  # 0.25; the padding's 9 not counted
            "rejection_rate": 1 / 2,
        }
    )


def test_no_part_on_gives_no_weights_and_masks_alone_give_zeros_and_ones():
    old = old_with_ratios([[0.25, 1.0, 4.0], [2.0, 3.0, 1.0]])
    assert rollout_correction_weights(RolloutCorrectionConfig(), old, ROLLOUT, MASK) == (None, {})
    icepop = RolloutCorrectionConfig(token_mask="icepop", token_mask_low=0.5, token_mask_high=3.5)
    weights, metrics = rollout_correction_weights(icepop, old, ROLLOUT, MASK)
    torch.testing.assert_close(weights, torch.tensor([[0.0, 1.0, 0.0], [1.0, 1.0, 1.0]]))
    assert "rejection_rate" not in metrics and metrics["is_clipped_frac"] == 0.0


def test_the_weights_are_constants_that_scale_each_token_gradient():
    """mode none, icepop [0.5, 5] and rejection of products above 3: row 0 (rho 0.25, 1) keeps token
    1 only, row 1 (rho 4, 1) is rejected. PPO ratio r = 1.1 / 0.9 (unclipped), token-mean over the 4
    tokens: d loss / d log_prob = -A * r * w / 4 -> only row 0 token 1: -(-1) * 0.9 * 1 / 4."""
    rollout = torch.full((2, 2), -1.0)
    old = (rollout + torch.tensor([[0.25, 1.0], [4.0, 1.0]]).log()).requires_grad_()
    log_prob = (old.detach() + torch.tensor([[1.1, 0.9], [1.1, 0.9]]).log()).requires_grad_()
    advantages, mask = torch.tensor([[1.0, -1.0], [1.0, 1.0]]), torch.ones(2, 2)
    cfg = RolloutCorrectionConfig(token_mask="icepop", rejection="sequence", rejection_upper=3.0)
    weights, _ = rollout_correction_weights(cfg, old, rollout, mask)
    assert not weights.requires_grad
    loss, _, _, _ = compute_policy_loss(old.detach(), log_prob, advantages, mask, is_weights=weights)
    loss.backward()
    torch.testing.assert_close(log_prob.grad, torch.tensor([[0.0, 0.9 / 4], [0.0, 0.0]]))
    assert loss.item() == pytest.approx(0.9 / 4)  # -A r w / 4 = 0.225, the rest weigh 0


def test_active_parts_name_what_is_on():
    assert active_parts(RolloutCorrectionConfig()) == []
    cfg = RolloutCorrectionConfig(token_mask="kpop", rejection="geometric", rejection_upper=2.0)
    assert active_parts(cfg) == ["token_mask=kpop", "rejection=geometric"]


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"mode": "decoupled_ppo", "level": "sequence"}, "used by mode=truncated_is and mode=masked_is only"),
        ({"token_mask": "icepop", "token_mask_low": 1.5}, r"0 < token_mask_low <= 1 <= token_mask_high"),
        ({"token_mask": "icepop", "token_mask_high": 0.9}, r"got 0.5 and 0.9"),
        ({"token_mask": "kpop", "kpop_threshold": 0.0}, "kpop_threshold > 0"),
        ({"rejection": "sequence"}, "rejection=sequence needs rejection_lower and/or rejection_upper"),
        ({"rejection_upper": 2.0}, "used by rejection=sequence or rejection=geometric only"),
        ({"rejection": "geometric", "rejection_lower": 1.5}, r"rejection_lower must be in \(0, 1\]"),
        ({"rejection": "geometric", "rejection_upper": 0.5}, "rejection_upper must be >= 1"),
    ],
)
def test_settings_that_cannot_work_are_refused_with_the_key(settings, message):
    with pytest.raises(ValueError, match=message):
        validate_rollout_correction(RolloutCorrectionConfig(**settings))


def test_the_paper_settings_are_accepted():
    for cfg in (
        RolloutCorrectionConfig(mode="truncated_is", level="sequence", upper=2.0),
        RolloutCorrectionConfig(mode="masked_is", token_mask="icepop"),  # IcePop's 0.5 and 5
        RolloutCorrectionConfig(token_mask="kpop"),
        RolloutCorrectionConfig(rejection="geometric", rejection_lower=0.999, rejection_upper=1.001),
    ):
        validate_rollout_correction(cfg)
    assert math.isclose(RolloutCorrectionConfig().kpop_threshold, 0.1)


def test_settings_of_a_part_left_off_are_warned_about():
    cfg = RecipeConfig()
    assert _rollout_correction_settings_unread(cfg) == []
    section = cfg.algorithm.rollout_correction
    section.upper, section.token_mask_high, section.kpop_threshold = 3.0, 4.0, 0.2
    [warning] = _rollout_correction_settings_unread(cfg)
    assert warning.startswith(
        "algorithm.rollout_correction.upper=3.0, algorithm.rollout_correction.token_mask_high=4.0, "
        "algorithm.rollout_correction.kpop_threshold=0.2 have no effect with "
        "algorithm.rollout_correction.mode=none and algorithm.rollout_correction.token_mask=none"
    ), warning
    section.mode, section.token_mask = "truncated_is", "icepop"  # now upper and token_mask_high act
    [warning] = _rollout_correction_settings_unread(cfg)
    assert warning.startswith("algorithm.rollout_correction.kpop_threshold=0.2 has no effect with"), warning
