"""The staleness metrics of a trained batch against hand-counted values."""

import pytest

from hybridflow.trainer.disaggregated import staleness_metrics


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
