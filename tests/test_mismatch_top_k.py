"""The full-distribution mismatch check's math (hybridflow/algorithms/mismatch.py): the engine's
top-k log-probs against the actor's whole distribution, on values worked out by hand."""

import math

import pytest
import torch

from hybridflow.algorithms.mismatch import top_k_mismatch

LOG = math.log
# The actor's distribution over a 4-token vocabulary, the same at both positions (logits up to a
# constant: log_softmax must remove it).
ACTOR_PROBS = torch.tensor([0.4, 0.3, 0.2, 0.1])
ACTOR_LOGITS = (ACTOR_PROBS.log() + 3.0).expand(2, 4)
# Position 0: the engine's top-2 is {0, 1} with mu = 0.5, 0.25 (top-1 agrees with the actor's).
# Position 1: its top-2 is {2, 0} with mu = 0.6, 0.3 (top-1 is token 2, the actor's is token 0).
ENGINE_IDS = torch.tensor([[0, 1], [2, 0]])
ENGINE_LOG_PROBS = torch.tensor([[LOG(0.5), LOG(0.25)], [LOG(0.6), LOG(0.3)]])


def actor_view(ids: torch.Tensor, logits: torch.Tensor = ACTOR_LOGITS) -> tuple[torch.Tensor, torch.Tensor]:
    """What the actor reports: log pi of `ids` over its whole vocabulary, and its argmax."""
    return logits[: len(ids)].log_softmax(-1).gather(-1, ids), logits[: len(ids)].argmax(-1)


def test_kl_over_the_top_k_support_and_top1_agreement_equal_hand_computed_values():
    stats = top_k_mismatch(ENGINE_IDS, ENGINE_LOG_PROBS, *actor_view(ENGINE_IDS))
    # Position 0, renormalised on {0, 1}: mu_S = (2/3, 1/3), pi_S = (0.4, 0.3) / 0.7 = (4/7, 3/7)
    kl_0 = 2 / 3 * LOG((2 / 3) / (4 / 7)) + 1 / 3 * LOG((1 / 3) / (3 / 7))
    # Position 1, on {2, 0}: mu_S = (2/3, 1/3), pi_S = (0.2, 0.4) / 0.6 = (1/3, 2/3): KL = log(2) / 3
    kl_1 = 2 / 3 * LOG(2) + 1 / 3 * LOG(1 / 2)
    assert kl_0 == pytest.approx(0.0189956, abs=1e-7) and kl_1 == pytest.approx(LOG(2) / 3)
    assert stats["mismatch/top_k_kl_mean"] == pytest.approx((kl_0 + kl_1) / 2, rel=1e-5)
    assert stats["mismatch/top_k_kl_max"] == pytest.approx(kl_1, rel=1e-5)
    assert stats["mismatch/top1_agreement"] == pytest.approx(0.5)


def test_an_engine_that_agrees_with_the_actor_gives_zero_kl_and_full_agreement():
    """The engine's top-2 of the actor's own distribution: every number 0, the top-1 the same."""
    log_pi = ACTOR_LOGITS.log_softmax(-1)
    values, ids = log_pi.topk(2, dim=-1)
    stats = top_k_mismatch(ids, values, *actor_view(ids))
    assert stats["mismatch/top_k_kl_mean"] == pytest.approx(0.0, abs=1e-7)
    assert stats["mismatch/top_k_kl_max"] == pytest.approx(0.0, abs=1e-7)
    assert stats["mismatch/top1_agreement"] == 1.0


def test_a_top_k_entry_without_engine_mass_adds_no_term():
    """An engine sampling with top_k=1 reports -inf for its second token: 0 log 0 counts as 0 (not
    nan), so on {0, 1} mu_S = (1, 0), pi_S = (4/7, 3/7) and the KL is log(7/4)."""
    stats = top_k_mismatch(ENGINE_IDS[:1], torch.tensor([[0.0, -math.inf]]), *actor_view(ENGINE_IDS[:1]))
    assert stats["mismatch/top_k_kl_mean"] == pytest.approx(LOG(7 / 4), rel=1e-6)
    assert stats["mismatch/top1_agreement"] == 1.0


def test_no_positions_is_an_error():
    with pytest.raises(ValueError, match="at least one position"):
        top_k_mismatch(ENGINE_IDS[:0], ENGINE_LOG_PROBS[:0], *actor_view(ENGINE_IDS[:0]))
