"""The staleness metrics of a trained batch against hand-counted values."""

import pytest
import torch

from engines.rollout.base import pad_rows
from hybridflow.trainer.metrics import rollout_replica_metrics
from hybridflow.trainer.rollout.pool import mixed_version_share, staleness_metrics


def test_staleness_mean_max_and_histogram():
    metrics = staleness_metrics(trained_on=5, sample_versions=[5, 4, 4, 3])  # staleness 0, 1, 1, 2
    assert metrics == {
        "async/staleness_mean": pytest.approx(1.0),
        "async/staleness_max": 2.0,
        "async/staleness/0": 0.25,
        "async/staleness/1": 0.5,
        "async/staleness/2": 0.25,
    }


def test_fresh_samples_are_all_at_staleness_zero():
    assert staleness_metrics(0, [0, 0]) == {
        "async/staleness_mean": 0.0,
        "async/staleness_max": 0.0,
        "async/staleness/0": 1.0,
    }


def test_mixed_version_share_counts_rows_sampled_by_two_versions():
    versions = torch.tensor(
        [
            [3, 3, 4, -1],  # interrupted by the update to 4
            [3, 3, 3, 3],
            [4, -1, -1, -1],  # started after it
            [2, 3, 4, 4],  # two updates
        ]
    )  # (B, R)
    assert mixed_version_share(versions) == 0.5


def test_pad_rows_right_pads_to_the_longest_row():
    padded = pad_rows([[1, 2], [3], []], -1, torch.long)
    assert padded.tolist() == [[1, 2], [3, -1], [-1, -1]] and padded.dtype == torch.long
    assert pad_rows([], 0, torch.float32).shape == (0, 0)


def test_prefix_cache_hit_rate_and_each_replicas_share_of_the_batch():
    tensors = {
        "prefill_tokens": torch.tensor([100, 100, 50, 50, 60]),
        "prefix_cached_tokens": torch.tensor([64, 0, 32, 32, 0]),
        "rollout_replica": torch.tensor([1, 1, 0, 0, 0]),
        "response_mask": torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [0, 0, 0], [1, 0, 0]]),
    }
    assert rollout_replica_metrics(tensors) == {
        "rollout/prefix_cache_hit_rate": pytest.approx(128 / 360),
        "rollout/replica_0/samples": 3.0,
        "rollout/replica_0/response_tokens": 4.0,
        "rollout/replica_0/prefix_cache_hit_rate": pytest.approx(64 / 160),
        "rollout/replica_1/samples": 2.0,
        "rollout/replica_1/response_tokens": 3.0,
        "rollout/replica_1/prefix_cache_hit_rate": pytest.approx(64 / 200),
    }


def test_no_hit_rate_without_prefill_counts_or_prompt_tokens():
    assert rollout_replica_metrics({"response_mask": torch.ones(2, 3)}) == {}
    nothing = {"prefill_tokens": torch.zeros(2, dtype=torch.long), "prefix_cached_tokens": torch.zeros(2)}
    assert rollout_replica_metrics(nothing) == {}  # an engine that took no prompt tokens: no rate
