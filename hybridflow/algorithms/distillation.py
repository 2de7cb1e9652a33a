"""On-policy distillation: a teacher's per-token log-probs of the student's own samples as a dense
training signal, fed through the existing policy-gradient loss.

The student samples y ~ pi_s; a frozen teacher scores every sampled token. The objective is the
reverse KL, KL(pi_s || pi_t) = E_{y ~ pi_s}[sum_t log pi_s(y_t | y_<t) - log pi_t(y_t | y_<t)],
and its per-token sample estimate, log pi_s(y_t) - log pi_t(y_t), enters the loss as a negative
per-token advantage (discount 0: each token is credited only with its own estimate). Tokens the
teacher finds likelier than the student are pushed up, the others down, so the student learns
from its own mistakes rather than from teacher-written text.

- Agarwal et al., "On-Policy Distillation of Language Models: Learning from Self-Generated
  Mistakes", ICLR 2024 (GKD): on-policy student samples, reverse KL as the divergence.
- Thinking Machines, "On-Policy Distillation" (2025): the per-token reverse KL as the advantage of
  an importance-sampled policy-gradient loss, discount zero, optionally beside the task reward.

Shapes: B responses, R response positions; masks hold 1 on response tokens.
"""

import torch

from hybridflow.algorithms.kl import kl_penalty
from hybridflow.algorithms.masked import masked_mean

# k1: log pi_s - log pi_t, the unbiased estimate whose policy gradient is the reverse KL's own
# (the default, as in Thinking Machines and verl); k3: pi_t / pi_s - 1 - log(pi_t / pi_s), also
# unbiased for the KL's value, never negative and of lower variance (Schulman 2020), but as a
# reward its gradient is no longer exactly the reverse KL's.
DISTILL_KL_ESTIMATORS = ("k1", "k3")


def reverse_kl(
    student_log_probs: torch.Tensor, teacher_log_probs: torch.Tensor, estimator: str = "k1"
) -> torch.Tensor:
    """Per-token estimate of KL(pi_s || pi_t) at the sampled tokens, (B, R)."""
    if estimator not in DISTILL_KL_ESTIMATORS:
        raise ValueError(
            f"distillation KL estimator must be one of {DISTILL_KL_ESTIMATORS}, got {estimator!r}"
        )
    return kl_penalty(student_log_probs, teacher_log_probs, estimator)  # (B, R)


def distillation_advantages(
    task_advantages: torch.Tensor,
    student_log_probs: torch.Tensor,
    teacher_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    kl_coef: float = 1.0,
    task_coef: float = 0.0,
    estimator: str = "k1",
) -> torch.Tensor:
    """A_t = task_coef * A_task_t - kl_coef * KL_t, zero on padding, (B, R).

    task_coef = 0 is pure distillation (the task reward is ignored); task_coef > 0 mixes in the
    advantages of the recipe's estimator (GRPO, GAE, ...). The KL term is not whitened or
    normalised: its scale is the teacher-student gap in nats, which is what Thinking Machines use.
    """
    kl = reverse_kl(student_log_probs, teacher_log_probs, estimator)  # (B, R)
    mask = response_mask.to(kl.dtype)  # (B, R)
    return (task_coef * task_advantages - kl_coef * kl) * mask  # (B, R)


def distillation_metrics(
    student_log_probs: torch.Tensor, teacher_log_probs: torch.Tensor, response_mask: torch.Tensor
) -> dict[str, float]:
    """Per-token means over the response tokens: the reverse KL (k1), both log-probs, and the share
    of tokens where the teacher is more confident than the student (log pi_t > log pi_s)."""
    mask = response_mask.float()  # (B, R)
    teacher_surer = (teacher_log_probs > student_log_probs).float()  # (B, R)
    return {
        "distill/reverse_kl": masked_mean(student_log_probs - teacher_log_probs, mask).item(),
        "distill/student_log_prob": masked_mean(student_log_probs, mask).item(),
        "distill/teacher_log_prob": masked_mean(teacher_log_probs, mask).item(),
        "distill/teacher_more_confident": masked_mean(teacher_surer, mask).item(),
    }
