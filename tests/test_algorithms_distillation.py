"""On-policy distillation's advantage and metrics on log-probs chosen so the answers are known by
hand (probabilities 1/2, 1/4, 1/8: every log ratio is a multiple of ln 2)."""

import math

import pytest
import torch

from hybridflow.algorithms.distillation import distillation_advantages, distillation_metrics, reverse_kl

LN2 = math.log(2.0)

# two responses, three positions; the second response's last position is padding
STUDENT = torch.log(torch.tensor([[0.5, 0.25, 0.5], [0.125, 0.5, 0.9]]))
TEACHER = torch.log(torch.tensor([[0.25, 0.25, 1.0], [0.5, 0.125, 0.1]]))
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])


def test_k1_is_the_log_ratio_per_token():
    kl = reverse_kl(STUDENT, TEACHER, "k1")
    expected = torch.tensor([[LN2, 0.0, -LN2], [-2 * LN2, 2 * LN2, math.log(9.0)]])
    torch.testing.assert_close(kl, expected)


def test_k3_is_ratio_minus_one_minus_log_ratio():
    # r = p_t / p_s: 1/2 -> 1/2 - 1 + ln 2; 1 -> 0; 2 -> 2 - 1 - ln 2; 4 -> 3 - 2 ln 2; 1/4 -> -3/4 + 2 ln 2
    kl = reverse_kl(STUDENT, TEACHER, "k3")
    expected = torch.tensor(
        [[LN2 - 0.5, 0.0, 1.0 - LN2], [3.0 - 2 * LN2, 2 * LN2 - 0.75, 1 / 9 - 1 + math.log(9.0)]]
    )
    torch.testing.assert_close(kl, expected)
    assert (kl >= 0).all()


def test_pure_distillation_is_the_negative_kl_and_zero_on_padding():
    task = torch.full((2, 3), 5.0)  # ignored at task_coef 0
    adv = distillation_advantages(task, STUDENT, TEACHER, MASK)
    expected = torch.tensor([[-LN2, 0.0, LN2], [2 * LN2, -2 * LN2, 0.0]])
    torch.testing.assert_close(adv, expected)


def test_mixed_with_the_task_advantage_by_the_coefficients():
    task = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]])
    adv = distillation_advantages(task, STUDENT, TEACHER, MASK, kl_coef=0.5, task_coef=2.0)
    expected = torch.tensor([[2 - LN2 / 2, 2.0, 2 + LN2 / 2], [-2 + LN2, -2 - LN2, 0.0]])
    torch.testing.assert_close(adv, expected)


def test_metrics_are_means_over_response_tokens():
    metrics = distillation_metrics(STUDENT, TEACHER, MASK)
    # valid tokens' log ratios: ln2, 0, -ln2, -2ln2, 2ln2 -> mean 0
    assert metrics["distill/reverse_kl"] == pytest.approx(0.0, abs=1e-7)
    # student: ln(1/2) + ln(1/4) + ln(1/2) + ln(1/8) + ln(1/2) = -8 ln 2
    assert metrics["distill/student_log_prob"] == pytest.approx(-8 * LN2 / 5)
    # teacher: ln(1/4) + ln(1/4) + 0 + ln(1/2) + ln(1/8) = -8 ln 2
    assert metrics["distill/teacher_log_prob"] == pytest.approx(-8 * LN2 / 5)
    # teacher surer at (0, 2) and (1, 0); the tie at (0, 1) does not count, the padding neither
    assert metrics["distill/teacher_more_confident"] == pytest.approx(2 / 5)


def test_unknown_estimator_is_refused_by_name():
    with pytest.raises(ValueError, match="k2"):
        reverse_kl(STUDENT, TEACHER, "k2")
