"""one_step and async modes, run in process (tests/recipe_runs.py): GRPO for 4 steps, actor 1 process,
vLLM rollout 1 process. The versions each trained sample was generated with are read back from
the run's policy_versions.jsonl: the first batch is fresh, later ones as stale as the mode allows
(their generation overlapped earlier steps' training), never staler."""

import json

import pytest
from gsm8k_tiny import ACTOR_AND_POOL_OF_ONE, cpu_overrides
from recipe_runs import run_recipe_in_process


@pytest.mark.slow
@pytest.mark.parametrize(
    ("mode", "staleness"),
    [
        (["trainer.async_training.mode=one_step"], [0, 1, 1, 1]),
        (["trainer.async_training.mode=async", "trainer.async_training.max_staleness=1"], [0, 1, 1, 1]),
        (["trainer.async_training.mode=async", "trainer.async_training.max_staleness=2"], [0, 1, 2, 2]),
    ],
    ids=["one_step", "async-max_staleness-1", "async-max_staleness-2"],
)
def test_generation_ahead_trains_on_samples_no_staler_than_allowed(gsm8k_local, tmp_path, mode, staleness):
    out = tmp_path / "ahead"
    steps, versions = run_ahead(gsm8k_local, out, mode)
    assert [{v["trained_on"] - s for s in v["sample_versions"]} for v in versions] == [{s} for s in staleness]
    # the same staleness in the step metrics, and the weight transfers timed
    assert [r["async/staleness_max"] for r in steps] == staleness
    assert [r[f"async/staleness/{s}"] for r, s in zip(steps, staleness, strict=True)] == [1.0] * 4
    assert all(r["timing/weight_sync"] >= 0 for r in steps)
    # how much of each batch's generation ran while the driver worked on earlier steps
    assert steps[0]["timing/gen_overlap"] == 0.0  # the first batch is generated before any step's work
    assert all(0 <= r["timing/gen_overlap"] <= r["timing/rollout_gen"] for r in steps)
    # stale samples are off-policy: the actor's log-probs of them differ from the engine's
    assert all(r["actor/rollout_actor_kl"] > 0 for r in steps[1:])
    assert all("actor/is_weight_mean" in r for r in steps)


@pytest.mark.slow
def test_partial_rollouts_train_on_samples_whose_oldest_token_is_no_staler_than_allowed(
    gsm8k_local, tmp_path
):
    """With partial rollouts the launched batches generate side by side and a transfer lands between
    two decoding steps: a sample's version is its oldest token's. Where the transfers land depends
    on timing, so the share of samples of two versions is reported, not asserted."""
    partial = [
        "trainer.async_training.mode=async",
        "trainer.async_training.max_staleness=2",
        "trainer.async_training.partial_rollout=true",
    ]
    steps, versions = run_ahead(gsm8k_local, tmp_path / "partial", partial)
    staleness = [{v["trained_on"] - s for s in v["sample_versions"]} for v in versions]
    assert staleness[0] == {0} and all(s <= {0, 1, 2} for s in staleness), staleness
    assert all(0 <= r["async/mixed_version_share"] <= 1 for r in steps)
    assert all(r["async/staleness_max"] == max(s) for r, s in zip(steps, staleness, strict=True))


def run_ahead(local: dict, out, mode: list[str]) -> tuple[list[dict], list[dict]]:
    """A 4-step GRPO run in `mode`; its step metrics and recorded policy versions."""
    overrides = [
        *cpu_overrides(local, out, tp=1),
        *mode,
        *ACTOR_AND_POOL_OF_ONE,
        "trainer.total_training_steps=4",
        "trainer.test_freq=4",
        "trainer.save_freq=0",
        "rollout.name=vllm",
        "rollout.sampling.n=2",
        "rollout.calculate_log_probs=true",
        "actor.update.ppo_mini_batch_size=4",
        "algorithm.rollout_correction.mode=decoupled_ppo",
    ]
    result = run_recipe_in_process("recipes/gsm8k_grpo.yaml", overrides, pythonpath=local["root"])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    assert "val/accuracy" in steps[-1]
    versions = [json.loads(line) for line in (out / "policy_versions.jsonl").read_text().splitlines()]
    assert [v["trained_on"] for v in versions] == [0, 1, 2, 3]
    return steps, versions
