"""The driver's reading of a step's metrics for NaN / inf and for refused (too large) updates
(hand-made metrics)."""

from hybridflow.config.schema import RecipeConfig
from hybridflow.protocol import DataProto
from hybridflow.trainer.metrics import mean_worker_metrics
from hybridflow.utils.nonfinite import nonfinite_update, refused_updates


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


def test_refused_updates_name_the_ratio_and_the_setting_of_each_role():
    cfg = RecipeConfig()
    cfg.critic.update.max_update_ratio = 0.5
    metrics = {
        "actor/update_ratio_max": 31.0,
        "actor/update_refused": 0.25,  # one of four optimizer steps
        "critic/update_ratio_max": 0.1,
        "critic/update_refused": 0.0,
        "sft/update_ratio_max": 0.7,
        "sft/update_refused": 1.0,
    }
    assert refused_updates(metrics, cfg) == [
        "actor/update_ratio_max is 31, over actor.update.max_update_ratio=0.25",
        "sft/update_ratio_max is 0.7, over actor.update.max_update_ratio=0.25",
    ]
    assert sorted(metrics) == ["actor/update_ratio_max", "critic/update_ratio_max", "sft/update_ratio_max"]


def test_a_workers_largest_update_ratio_is_kept_where_other_metrics_are_averaged():
    output = DataProto(
        meta_info={"metrics": {"actor/update_ratio_max": [0.1, 0.3, 0.2], "actor/lr": [1.0, 3.0]}}
    )
    assert mean_worker_metrics(output) == {"actor/update_ratio_max": 0.3, "actor/lr": 2.0}
