"""Routing replay (docs/routing-replay.md) on a dense model is refused before Ray starts, naming the
setting that asks for it and the value that switches it off. Without this check the hf engine
refused only once its workers had started (no router to hook), and the actor replayed nothing
without a word (a dense model has no routers). Run through the real entry point, as
tests/test_bad_inputs.py runs its table (tests/entry_point_checks.py: Ray's start fails the test)."""

import pytest
import yaml
from entry_point_checks import RayStarted, base_recipe, run_in_process

from hybridflow.data.arith import ArithConfig, write_arith_parquet
from hybridflow.utils.tiny_model import make_tiny_model

RECORD = "rollout.return_routed_experts=true"
REPLAY = "actor.megatron.moe_routing_replay=rollout"


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict:
    """A valid tiny recipe (tests/entry_point_checks.py's) and a dense and a MoE tiny model."""
    root = tmp_path_factory.mktemp("replay_preflight")
    files = {
        "tiny": make_tiny_model(root / "dense", num_layers=2),
        "moe": make_tiny_model(root / "moe", arch="qwen3_moe", num_layers=2, num_experts=4),
        "out": root / "out",
    }
    files.update(write_arith_parquet(root / "data", ArithConfig(num_train=8, num_test=4, seed=3)))
    files["recipe"] = root / "recipe.yaml"
    files["recipe"].write_text(yaml.safe_dump(base_recipe(files)))
    return files


def argv(files: dict, model: str, *overrides: str) -> list[str]:
    # TP 1: the tiny MoE's 4 experts are not split over TP 2 here (only the check is under test)
    tp1 = "actor.megatron.tensor_model_parallel_size=1"
    return [str(files["recipe"]), f"model.path={files[model]}", tp1, *overrides]


@pytest.mark.parametrize(
    ("overrides", "fix"),
    [
        ([RECORD], "rollout.return_routed_experts=false"),
        ([RECORD, REPLAY], "rollout.return_routed_experts=false and actor.megatron.moe_routing_replay=off"),
    ],
    ids=["record", "record_and_replay"],
)
def test_replay_on_a_dense_model_is_refused_before_ray(overrides, fix, files, monkeypatch, capsys):
    code, err = run_in_process(argv(files, "tiny", *overrides), monkeypatch, capsys)
    assert code == 2, err
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, err
    assert errors[0].startswith(
        f"error: {' and '.join(overrides)}: routing replay needs a mixture-of-experts"
    )
    dense = f"model.path={files['tiny']} is a dense model (Qwen2ForCausalLM, no experts in its config.json)"
    assert f"{dense}; set {fix}, or use a Qwen3-MoE or Mixtral model" in errors[0]
    assert not (files["out"] / "config.yaml").exists()  # refused before the run was recorded


def test_replay_on_a_moe_model_gets_as_far_as_ray(files, monkeypatch, capsys):
    """The control: the same settings on the tiny Qwen3-MoE pass every check."""
    with pytest.raises(RayStarted):
        run_in_process(argv(files, "moe", RECORD, REPLAY), monkeypatch, capsys)
    (files["out"] / "config.yaml").unlink()


RECOMPUTE = (
    "actor.megatron.transformer.recompute_granularity=full",
    "actor.megatron.transformer.recompute_method=uniform",
    "actor.megatron.transformer.recompute_num_layers=1",
)


def test_replay_with_activation_recompute_gets_as_far_as_ray(files, monkeypatch, capsys):
    """Recompute replays each micro-batch's own routes (tests/megatron/test_recompute.py): allowed."""
    with pytest.raises(RayStarted):
        run_in_process(argv(files, "moe", RECORD, REPLAY, *RECOMPUTE), monkeypatch, capsys)
    (files["out"] / "config.yaml").unlink()


def test_replay_with_expert_capacity_is_refused_before_ray(files, monkeypatch, capsys):
    """A capacity drops tokens the engine never dropped, and Megatron-Core counts padding positions
    (replayed to experts 0..k-1) against it: refused by name."""
    capacity = "actor.megatron.transformer.moe_expert_capacity_factor=1.0"
    code, err = run_in_process(argv(files, "moe", RECORD, REPLAY, capacity), monkeypatch, capsys)
    assert code == 2, err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert errors == [
        "error: invalid recipe: actor.megatron.moe_routing_replay=rollout needs "
        "actor.megatron.transformer.moe_expert_capacity_factor unset (dropless, as the rollout engine "
        "routes; Megatron-Core counts padding positions against an expert's capacity), got 1.0"
    ], err
    assert not (files["out"] / "config.yaml").exists()
