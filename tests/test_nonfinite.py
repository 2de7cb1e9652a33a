"""The driver's reading of a step's metrics for NaN / inf (hand-made metrics)."""

from hybridflow.utils.nonfinite import nonfinite_update


def test_nonfinite_metrics_are_named_and_worker_skip_flags_removed():
    metrics = {
        "reward/mean": 0.5,
        "actor/grad_norm": float("nan"),
        "actor/nonfinite_skipped": 0.5,
        "critic/vf_loss": float("-inf"),
        "critic/nonfinite_skipped": 0.0,
    }
    assert nonfinite_update(metrics) == ["actor/grad_norm is nan", "critic/vf_loss is -inf"]
    assert sorted(metrics) == ["actor/grad_norm", "critic/vf_loss", "reward/mean"]


def test_finite_step_has_no_problem():
    metrics = {"reward/mean": 0.5, "actor/grad_norm": 1.5, "actor/nonfinite_skipped": 0.0}
    assert nonfinite_update(metrics) == []
    assert metrics == {"reward/mean": 0.5, "actor/grad_norm": 1.5}
