"""The sampling distribution under top-k / top-p (hybridflow/algorithms/sampling.py): kept sets and
renormalised log-probs against values worked out by hand, and kept sets against the two samplers
the rollout engines run (vLLM 0.32's `apply_top_k_top_p_pytorch` and `apply_top_k_only`,
transformers' `TopKLogitsWarper` then `TopPLogitsWarper`) on random logits."""

import math

import pytest
import torch

from hybridflow.algorithms.sampling import Truncation, keep_labels, kept_tokens, truncated_log_softmax

PROBS = torch.tensor([0.5, 0.3, 0.15, 0.05])
LOGITS = PROBS.log() + 2.0  # (V,) = (4,), up to a constant


def kept(truncation: Truncation, logits: torch.Tensor = LOGITS) -> list[int]:
    return kept_tokens(logits, truncation).nonzero().flatten().tolist()


def test_kept_sets_equal_hand_computed_ones():
    # ascending cumulative probabilities: 0.05, 0.2, 0.5, 1.0
    assert kept(Truncation()) == [0, 1, 2, 3]
    assert kept(Truncation(top_p=0.9)) == [0, 1, 2]  # drops cumulative <= 0.1: 0.05
    assert kept(Truncation(top_p=0.6)) == [0, 1]  # drops <= 0.4: 0.05, 0.2
    assert kept(Truncation(top_p=0.01)) == [0]  # the most likely token always stays
    assert kept(Truncation(top_k=2)) == [0, 1]
    assert kept(Truncation(top_k=9)) == [0, 1, 2, 3]  # k beyond the vocabulary: no filter


def test_top_p_applies_to_the_top_k_survivors_renormalised():
    """top_k=3 leaves 0.5, 0.3, 0.15 -> (10, 6, 3) / 19; ascending cumulative 3/19 = 0.158, 9/19:
    top_p=0.82 drops <= 0.18, token 2. Over the whole vocabulary it would drop only token 3."""
    assert kept(Truncation(top_k=3, top_p=0.82)) == [0, 1]
    assert kept(Truncation(top_p=0.82)) == [0, 1, 2]


def test_the_temperature_changes_the_top_p_set():
    """At T = 2, p is proportional to sqrt(0.5, 0.3, 0.15, 0.05) = (0.707, 0.548, 0.387, 0.224),
    sum 1.866: the least likely token has 0.1198 > 0.1, so top_p=0.9 keeps all four."""
    assert kept(Truncation(top_p=0.9), LOGITS / 2.0) == [0, 1, 2, 3]


def test_top_k_keeps_ties():
    assert kept(Truncation(top_k=1), torch.tensor([1.0, 1.0, 0.0])) == [0, 1]


def test_log_probs_are_renormalised_over_the_kept_tokens():
    log_p = truncated_log_softmax(LOGITS.expand(2, 3, 4), Truncation(top_p=0.9))  # (B, R, V)
    assert log_p.shape == (2, 3, 4)
    expected = [math.log(0.5 / 0.95), math.log(0.3 / 0.95), math.log(0.15 / 0.95), -math.inf]
    assert log_p[1, 2].tolist() == pytest.approx(expected, rel=1e-6)
    top_2 = truncated_log_softmax(LOGITS, Truncation(top_k=2))
    assert top_2.tolist() == pytest.approx([math.log(0.625), math.log(0.375), -math.inf, -math.inf], rel=1e-6)
    assert torch.equal(truncated_log_softmax(LOGITS, Truncation()), LOGITS.log_softmax(-1))


def test_a_label_outside_the_kept_set_is_kept_with_a_finite_log_prob():
    """Token 3 (p = 0.05) sampled although top_p=0.9 drops it: it joins the kept set, whose mass is
    then 1.0: log p = log 0.05. Its neighbours' labels change nothing at their positions."""
    logits = LOGITS.expand(2, 4)  # (B, V)
    labels = torch.tensor([3, 0])  # (B,)
    log_p = truncated_log_softmax(logits, Truncation(top_p=0.9), labels)  # (B, V)
    assert log_p[0, 3].item() == pytest.approx(math.log(0.05), rel=1e-6)
    assert log_p[1, 3].item() == -math.inf
    keep = keep_labels(torch.zeros(2, 4, dtype=torch.bool), labels)
    assert keep.tolist() == [[False, False, False, True], [True, False, False, False]]


def test_settings_out_of_range_are_refused():
    with pytest.raises(ValueError, match="top_k must be -1"):
        Truncation(top_k=0)
    with pytest.raises(ValueError, match="top_p must be in"):
        Truncation(top_p=0.0)
    assert not Truncation().active and Truncation(top_p=0.5).active
    assert Truncation.from_meta({"top_k": 5, "temperature": 0.7}) == Truncation(top_k=5)


CASES = [Truncation(top_p=0.9), Truncation(top_k=5), Truncation(top_k=20, top_p=0.7), Truncation(top_p=0.3)]


@pytest.mark.parametrize("truncation", CASES, ids=str)
def test_kept_sets_equal_vllms(truncation):
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_only, apply_top_k_top_p_pytorch

    logits = torch.randn(64, 300, generator=torch.Generator().manual_seed(0)) * 3  # (N, V)
    k = None if truncation.top_k == -1 else torch.full((64,), truncation.top_k)
    p = None if truncation.top_p == 1.0 else torch.full((64,), truncation.top_p)
    theirs = apply_top_k_top_p_pytorch(logits.clone(), k, p, allow_cpu_sync=False)
    assert torch.equal(kept_tokens(logits, truncation), theirs > -math.inf)
    if p is None:  # vLLM's CPU path for top-k alone
        assert torch.equal(kept_tokens(logits, truncation), apply_top_k_only(logits.clone(), k) > -math.inf)


@pytest.mark.parametrize("truncation", CASES, ids=str)
def test_kept_sets_equal_transformers(truncation):
    from transformers import TopKLogitsWarper, TopPLogitsWarper

    logits = torch.randn(64, 300, generator=torch.Generator().manual_seed(1)) * 3  # (N, V)
    theirs = logits.clone()
    if truncation.top_k != -1:
        theirs = TopKLogitsWarper(truncation.top_k)(None, theirs)
    if truncation.top_p < 1.0:
        theirs = TopPLogitsWarper(truncation.top_p)(None, theirs)
    assert torch.equal(kept_tokens(logits, truncation), theirs > -math.inf)
