"""DAPO (Yu et al. 2025, arXiv:2503.14476), GSPO (Zheng et al. 2025, arXiv:2507.18071) and
Dr. GRPO (Liu et al. 2025, arXiv:2503.20783) against values worked out by hand."""

import math

import pytest
import torch

from hybridflow.algorithms import (
    compute_policy_loss,
    compute_policy_loss_gspo,
    groups_with_reward_variance,
    grpo,
    overlong_penalty,
)


def test_dynamic_sampling_keeps_only_groups_whose_rewards_differ():
    scores = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.5, 0.5, 3.0])
    index = ["a", "b", "a", "b", "c", "c", "d"]
    # a: {1, 1} all equal; b: {0, 1} differ; c: {0.5, 0.5} equal; d: a lone response has no variance
    expected = [False, True, False, True, False, False, False]
    assert groups_with_reward_variance(scores, index).tolist() == expected


def test_dynamic_sampling_checks_the_index_length():
    with pytest.raises(ValueError, match="index has 1 entries but there are 2 scores"):
        groups_with_reward_variance(torch.zeros(2), ["a"])


def test_overlong_penalty_is_dapo_eq_13():
    # L_max = 16, L_cache = 4: no penalty up to 12 tokens, then linear down to -1 at 16
    lengths = torch.tensor([10, 12, 13, 15, 16, 20])
    expected = [0.0, 0.0, -1 / 4, -3 / 4, -1.0, -1.0]
    torch.testing.assert_close(overlong_penalty(lengths, 16, 4), torch.tensor(expected))
    torch.testing.assert_close(
        overlong_penalty(lengths, 16, 4, penalty_factor=0.5), torch.tensor(expected) / 2
    )
    with pytest.raises(ValueError, match="buffer_length must be in"):
        overlong_penalty(lengths, 16, 17)


# Three sequences, response width 3. Per-token ratios pi / pi_old (padding marked "pad"):
#   seq 0: 2.0, 1.0        A = +1   s = sqrt(2 * 1)   = 1.41421 -> above 1 + 0.28: clipped
#   seq 1: 0.9, 1.0, pad   A = -1   s = sqrt(0.9 * 1) = 0.94868 -> inside [0.8, 1.28]
#   seq 2: 0.5, 0.5, 0.5   A = -1   s = 0.5                      -> below 0.8 with A < 0: clipped
TOKEN_RATIOS = torch.tensor([[2.0, 1.0, 1.0], [0.9, 1.0, 1.0], [0.5, 0.5, 0.5]])
GSPO_MASK = torch.tensor([[1, 1, 0], [1, 1, 0], [1, 1, 1]])
GSPO_ADV = torch.tensor([[1.0] * 3, [-1.0] * 3, [-1.0] * 3])


def test_gspo_sequence_ratio_and_clip_by_hand():
    log_prob = TOKEN_RATIOS.log().requires_grad_(True)
    pg_loss, clipfrac, ppo_kl, clipfrac_lower = compute_policy_loss_gspo(
        torch.zeros(3, 3), log_prob, GSPO_ADV, GSPO_MASK, clip_ratio_low=0.2, clip_ratio_high=0.28
    )
    s1 = math.sqrt(0.9)
    # seq-mean-token-mean of max(-A s, -A clip(s)): seq 0 -> -1.28, seq 1 -> s1, seq 2 -> 0.8
    assert pg_loss.item() == pytest.approx((-1.28 + s1 + 0.8) / 3)
    assert clipfrac.item() == pytest.approx(5 / 7)  # seq 0's 2 tokens and seq 2's 3 of 7 valid
    assert clipfrac_lower.item() == 0.0
    assert ppo_kl.item() == pytest.approx(-(math.log(2.0) + math.log(0.9) + 3 * math.log(0.5)) / 7)
    pg_loss.backward()
    # only seq 1 is unclipped: d(-A s)/d log pi_t = s / |y| = s1 / 2, then / 3 sequences; each of
    # its tokens gets the same gradient whatever its own ratio (token-level PPO would give 0.9, 1.0)
    expected = torch.tensor([[0.0, 0.0, 0.0], [s1 / 6, s1 / 6, 0.0], [0.0, 0.0, 0.0]])
    torch.testing.assert_close(log_prob.grad, expected)


def test_gspo_equals_ppo_when_every_sequence_has_one_token():
    # with |y| = 1 the sequence ratio is the token ratio: GSPO is PPO without dual clip
    log_prob = torch.tensor([[math.log(1.1)], [math.log(0.95)]])
    adv, mask = torch.tensor([[1.0], [-1.0]]), torch.ones(2, 1)
    gspo = compute_policy_loss_gspo(torch.zeros(2, 1), log_prob, adv, mask, 0.2, 0.2, "token-mean")
    ppo = compute_policy_loss(torch.zeros(2, 1), log_prob, adv, mask, 0.2, 0.2, 3.0, "token-mean")
    assert gspo[0].item() == pytest.approx(ppo[0].item())
    assert gspo[0].item() == pytest.approx((-1.1 + 0.95) / 2)


def test_dr_grpo_gradient_per_token_does_not_depend_on_length():
    """Dr. GRPO: A = r - mean(group) (no std division) and the loss summed over tokens, divided
    by the constant response width T instead of each response's length."""
    scores = torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]])  # rewards on the last token
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])
    advantages, _ = grpo(scores, mask, ["g", "g"], norm_adv_by_std=False)
    # group scores {1, 0}: mean 0.5, so A = +0.5 and -0.5 on every valid token
    torch.testing.assert_close(advantages, torch.tensor([[0.5, 0.5, 0.5, 0.0], [-0.5, 0.0, 0.0, 0.0]]))
    log_prob = torch.zeros(2, 4, requires_grad=True)  # ratio 1: no clipping
    loss, *_ = compute_policy_loss(
        torch.zeros(2, 4), log_prob, advantages, mask, loss_agg_mode="seq-mean-token-sum-norm"
    )
    # loss = (1 / G) sum_i sum_t (-A_i) / T with G = 2, T = 4: (-0.5 * 3 + 0.5 * 1) / 8
    assert loss.item() == pytest.approx((-1.5 + 0.5) / 8)
    loss.backward()
    # every valid token gets -A / (G T), whether its response has 3 tokens or 1
    torch.testing.assert_close(log_prob.grad, torch.tensor([[-1 / 16] * 3 + [0.0], [1 / 16, 0, 0, 0]]))
