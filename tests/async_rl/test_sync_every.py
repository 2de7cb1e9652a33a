"""trainer.async_training.sync_every k: the rollout engines get the policy's weights once they trail
it by k updates, not after every update, and every trained sample stays within its bound.

- `sync_due`, by hand: which steps transfer, counted in versions (a refused update counts for
  nothing);
- the recipe check: k >= 1, refused in mode=sync, and within max_staleness in async and stream;
- a stream against the fake engines of stream_fakes.py (virtual clock, heavy-tailed
  lengths): every sample within max_staleness though the engines lag, a transfer every k steps;
- GRPO runs in process (tests/recipe_runs.py), actor 1 process, vLLM rollout 1 process: stream and
  one_step with sync_every 2; policy_versions.jsonl and the metrics read back.
"""

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from gsm8k_tiny import ACTOR_AND_POOL_OF_ONE, cpu_overrides
from recipe_runs import run_recipe_in_process
from stream_fakes import PROMPTS, VALIDATION_TICKS, check_batch, stream_trainer, train_step

from hybridflow.checks.recipe import RecipeError, validate_recipe
from hybridflow.config.loader import load_recipe
from hybridflow.protocol import DataProto
from hybridflow.trainer.rollout.pool import sync_due
from hybridflow.utils.tiny_model import make_tiny_model

GRPO = Path(__file__).resolve().parents[2] / "recipes/gsm8k_grpo.yaml"
KEY = "trainer.async_training"
PARTIAL = f"{KEY}.partial_rollout=true"


def synced_steps(versions: list[int], every: int) -> list[int]:
    """The steps (from 1) whose sync transfers, the policy at `versions[i]` at step i + 1."""
    served, steps = None, []
    for step, version in enumerate(versions, start=1):
        if sync_due(served, version, every):
            served = version
            steps.append(step)
    return steps


@pytest.mark.parametrize(
    ("versions", "every", "steps"),
    [
        ([0, 1, 2, 3, 4], 1, [1, 2, 3, 4, 5]),
        ([0, 1, 2, 3, 4], 2, [1, 3, 5]),
        ([0, 1, 2, 3, 4, 5], 2, [1, 3, 5]),
        ([0, 1, 2, 3, 4, 5, 6], 3, [1, 4, 7]),
        ([0, 1, 1, 2, 3], 2, [1, 4]),  # step 2's update was refused: version 1 twice
        ([0, 1, 1, 2, 3], 1, [1, 2, 4, 5]),  # nothing moves for a version the engines serve
    ],
)
def test_a_sync_transfers_once_the_engines_trail_by_sync_every_updates(versions, every, steps):
    assert synced_steps(versions, every) == steps


def test_after_a_sync_the_engines_trail_by_at_most_sync_every_minus_one():
    for every in (1, 2, 3):
        served = None
        for version in range(20):
            served = version if sync_due(served, version, every) else served
            assert 0 <= version - served <= every - 1


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> list[str]:
    """The GRPO recipe on a tiny model, disaggregated, vLLM, empty parquet files."""
    root = tmp_path_factory.mktemp("sync_every_config")
    model = make_tiny_model(root / "tiny")
    for name in ("train", "test"):
        (root / f"{name}.parquet").write_bytes(b"")
    return [
        f"model.path={model}",
        f"data.train_files=[{root / 'train.parquet'}]",
        f"data.val_files=[{root / 'test.parquet'}]",
        "trainer.use_gpu=false",
        *ACTOR_AND_POOL_OF_ONE,
        "rollout.name=vllm",
        "rollout.tensor_model_parallel_size=1",
        "actor.megatron.tensor_model_parallel_size=1",
        "data.max_prompt_length=256",
        "rollout.response_length=256",
    ]


def errors(base: list[str], *overrides: str) -> list[str]:
    cfg = load_recipe(GRPO, [*base, *overrides])
    try:
        validate_recipe(cfg, cuda_available=False)
    except RecipeError as err:
        return err.errors
    return []


@pytest.mark.usefixtures("in_quickstart_working_tree")
@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ((f"{KEY}.mode=one_step", f"{KEY}.sync_every=0"), f"{KEY}.sync_every must be >= 1"),
        (
            (f"{KEY}.sync_every=2",),
            f"{KEY}.sync_every=2 is used by mode=one_step, async or stream only",
        ),
        (
            (f"{KEY}.mode=async", f"{KEY}.max_staleness=1", f"{KEY}.sync_every=2"),
            f"{KEY}.sync_every=2 with max_staleness=1: the engines' weights may be 1 update(s) old",
        ),
        (
            (f"{KEY}.mode=stream", f"{KEY}.max_staleness=2", f"{KEY}.sync_every=3"),
            "set max_staleness >= 3 (max_staleness - sync_every + 1 batches then generate ahead)",
        ),
        (
            (f"{KEY}.mode=async", f"{KEY}.max_staleness=2", f"{KEY}.sync_every=2", PARTIAL),
            f"{KEY}.partial_rollout=true with max_staleness=2 and sync_every=2: no request is in flight "
            "when weights arrive (each launched batch is collected before the next transfer); set "
            "max_staleness >= 3",
        ),
    ],
)
def test_sync_every_outside_its_modes_or_beyond_the_bound_is_refused_by_name(base, overrides, message):
    found = errors(base, *overrides)
    assert any(message in e for e in found), found


@pytest.mark.usefixtures("in_quickstart_working_tree")
@pytest.mark.parametrize(
    ("overrides", "ahead"),
    [
        ((f"{KEY}.mode=one_step", f"{KEY}.sync_every=3"), None),  # one batch ahead: up to 3 old
        ((f"{KEY}.mode=async", f"{KEY}.max_staleness=2", f"{KEY}.sync_every=2"), 1),
        ((f"{KEY}.mode=async", f"{KEY}.max_staleness=4", f"{KEY}.sync_every=2", PARTIAL), 3),
        ((f"{KEY}.mode=stream", f"{KEY}.max_staleness=2", f"{KEY}.sync_every=2"), 1),
    ],
)
def test_sync_every_within_the_bound_is_accepted(base, overrides, ahead):
    assert errors(base, *overrides) == []
    settings = load_recipe(GRPO, [*base, *overrides]).trainer.async_training
    if ahead is not None:
        assert settings.batches_ahead() == ahead
        assert settings.groups_outstanding(4) == (ahead + 1) * 4


@pytest.mark.parametrize("stale_groups", ["drop", "regenerate"])
def test_a_stream_syncing_every_two_updates_trains_nothing_staler_than_its_bound(tmp_path, stale_groups):
    bound, every = 2, 2
    trainer = stream_trainer(tmp_path, stale_groups=stale_groups, bound=bound)
    trainer.rollout.settings = replace(trainer.rollout.settings, sync_every=every)
    lags, syncs, worst = [], [], 0
    for _ in range(trainer.total_steps):
        batch, metrics = train_step(trainer)
        check_batch(batch, trainer.policy.version - 1, bound)
        lags.append(metrics["async/engine_lag"])
        syncs.append(metrics["async/weight_syncs"])
        worst = max(worst, metrics["async/staleness_max"])
    assert syncs == [1.0, 0.0] * (trainer.total_steps // 2)
    assert lags == [0.0, 1.0] * (trainer.total_steps // 2)
    assert worst == bound  # the engines' lag shows in the samples: the bound is reached, not passed
    versions = [json.loads(line) for line in (tmp_path / "policy_versions.jsonl").read_text().splitlines()]
    assert [v["trained_on"] for v in versions] == list(range(trainer.total_steps))
    assert all(0 <= v["trained_on"] - s <= bound for v in versions for s in v["sample_versions"])


def test_validation_gets_the_newest_weights_whatever_sync_every(tmp_path):
    trainer = stream_trainer(tmp_path, bound=2)
    trainer.rollout.settings = replace(trainer.rollout.settings, sync_every=2)
    train_step(trainer)
    train_step(trainer)  # version 2; the engines were synced at step 1 (version 0) only
    assert trainer.engines.serving == 0
    trainer.rollout.pool.newest_weights()
    assert trainer.engines.serving == trainer.policy.version == 2
    _, metrics = train_step(trainer)  # the engines serve the version trained: nothing moves
    assert (metrics["async/weight_syncs"], metrics["async/engine_lag"]) == (1.0, 0.0)  # validation's


def validation_rows() -> DataProto:
    ids = torch.arange(PROMPTS)[:, None]  # (P, 1)
    return DataProto.from_dict({"input_ids": ids}, meta_info={"validate": True, "n": 1})


# after 1, 2, 3 steps the long groups in flight end 108; 96, 108; 85, 97, 109 ticks later
@pytest.mark.parametrize(("steps_before", "ending"), [(1, 0), (2, 1), (3, 2)])
def test_validation_generates_beside_the_groups_in_flight_which_go_on(tmp_path, steps_before, ending):
    """The pipeline is not drained for validation: the groups in flight when it begins keep
    generating during it; the next step's metrics count them and those that finished meanwhile, as
    read off the fake engines' clock; validation's responses are of the newest version."""
    trainer = stream_trainer(tmp_path, bound=2)
    trainer.rollout.settings = replace(trainer.rollout.settings, sync_every=2)
    for _ in range(steps_before):
        train_step(trainer)
    engines, start = trainer.engines, trainer.engines.clock
    generating = [h for h in trainer.rollout.in_flight if engines.calls[h]["end"] > start]
    finishing = [h for h in generating if engines.calls[h]["end"] <= start + VALIDATION_TICKS]
    assert (len(generating), len(finishing)) == (steps_before, ending)
    responses = trainer.rollout.generate(validation_rows())
    assert responses.batch["policy_version"].tolist() == [trainer.policy.version] * PROMPTS
    assert engines.clock == start + VALIDATION_TICKS
    _, metrics = train_step(trainer)
    assert metrics["stream/groups_generating_at_validation"] == len(generating)
    assert metrics["stream/groups_finished_during_validation"] == len(finishing)
    _, metrics = train_step(trainer)  # counted once: the step after has no validation
    assert metrics["stream/groups_generating_at_validation"] == 0
    assert metrics["stream/groups_finished_during_validation"] == 0


def test_a_direct_call_that_is_not_validation_is_not_counted_as_one(tmp_path):
    trainer = stream_trainer(tmp_path, bound=2)
    train_step(trainer)
    rows = validation_rows()
    rows.meta_info["validate"] = False  # e.g. ReMax's greedy baseline
    trainer.rollout.generate(rows)
    _, metrics = train_step(trainer)
    assert metrics["stream/groups_generating_at_validation"] == 0


STEPS = 5


def run_grpo(local: dict, out: Path, mode: list[str]) -> tuple[list[dict], list[dict]]:
    """A STEPS-step GRPO run with sync_every 2; its step metrics and recorded policy versions."""
    overrides = [
        *cpu_overrides(local, out, tp=1),
        *mode,
        f"{KEY}.sync_every=2",
        *ACTOR_AND_POOL_OF_ONE,
        f"trainer.total_training_steps={STEPS}",
        f"trainer.test_freq={STEPS}",  # after the last step's metrics: no step counts its transfer
        "trainer.save_freq=0",
        "rollout.name=vllm",
        "rollout.sampling.n=2",
        "rollout.calculate_log_probs=true",
        "actor.update.ppo_mini_batch_size=4",
    ]
    result = run_recipe_in_process("recipes/gsm8k_grpo.yaml", overrides, pythonpath=local["root"])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    versions = [json.loads(line) for line in (out / "policy_versions.jsonl").read_text().splitlines()]
    steps = [r for r in records if "reward/mean" in r]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    assert "val/accuracy" in steps[-1]  # validated with the newest weights, transferred for it
    assert steps[-1]["val/policy_version"] == STEPS  # as the engines stamped the responses
    assert [v["trained_on"] for v in versions] == list(range(STEPS))
    return steps, versions


def check_syncs(steps: list[dict]) -> None:
    """A transfer at steps 1, 3, 5: ceil(STEPS / 2) in all; the engines one update behind between."""
    assert [r["async/weight_syncs"] for r in steps] == [1.0, 0.0, 1.0, 0.0, 1.0]
    assert sum(r["async/weight_syncs"] for r in steps) == math.ceil(STEPS / 2)
    assert [r["async/engine_lag"] for r in steps] == [0.0, 1.0, 0.0, 1.0, 0.0]


@pytest.mark.slow
def test_a_stream_run_syncing_every_two_updates_keeps_every_sample_within_its_bound(gsm8k_local, tmp_path):
    mode = [f"{KEY}.mode=stream", f"{KEY}.max_staleness=2"]
    steps, versions = run_grpo(gsm8k_local, tmp_path / "stream", mode)
    staleness = [[v["trained_on"] - s for s in v["sample_versions"]] for v in versions]
    assert all(0 <= s <= 2 for step in staleness for s in step), staleness
    assert [r["async/staleness_max"] for r in steps] == [max(s) for s in staleness]
    check_syncs(steps)


@pytest.mark.slow
def test_a_one_step_run_syncing_every_two_updates_trains_samples_one_or_two_versions_old(
    gsm8k_local, tmp_path
):
    """Batch k + 1 is launched at step k with the weights the engines serve: version k - 1 after a
    step that transferred, k - 2 after one that did not."""
    steps, versions = run_grpo(gsm8k_local, tmp_path / "one_step", [f"{KEY}.mode=one_step"])
    staleness = [{v["trained_on"] - s for s in v["sample_versions"]} for v in versions]
    assert staleness == [{0}, {1}, {2}, {1}, {2}]
    check_syncs(steps)
