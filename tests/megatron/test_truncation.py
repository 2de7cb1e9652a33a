"""The actor's log-probs, entropies and sum of squared probabilities, with no filter and under top-k /
top-p sampling, with the vocabulary whole (TP 1) and sharded (TP 2): tests/megatron/_truncation_worker.py
against transformers' warpers on one process."""

import pytest
from launch import run_distributed


@pytest.mark.parametrize("tp", [1, 2])
def test_truncated_log_probs_entropies_and_gradients_match_the_whole_vocabulary(tp):
    assert "TRUNCATION OK" in run_distributed("_truncation_worker.py", tp, timeout=600)
