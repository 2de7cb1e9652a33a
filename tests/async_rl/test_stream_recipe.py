"""mode=stream through `scripts/run_recipe.sh`: streaming GRPO for 6 steps (actor 1 process, vLLM
rollout 1 process, max_staleness 1), a checkpoint at step 3 with groups outstanding, and a second
run resumed from it for steps 4-6. Every trained sample's staleness, read back from each run's
policy_versions.jsonl, is within the bound; stale groups are counted in every step's metrics; the
checkpoint's rollout part holds what was outstanding (finished groups, prompts to regenerate)."""

import json
from itertools import pairwise

import pytest
import torch
from test_recipes import cpu_overrides, local, run_recipe  # noqa: F401 (local is a fixture)

from hybridflow.trainer.rollout.stream import STREAM_FILE

BOUND, GROUPS = 1, 4  # max_staleness; data.train_batch_size (cpu_overrides)


def stream_run(files: dict, out, *extra: str) -> tuple[list[dict], list[dict]]:
    """A streaming GRPO run of 6 steps; its step metrics and recorded policy versions."""
    overrides = [
        *cpu_overrides(files, out, tp=1),
        "trainer.n_gpus_per_node=1",
        "trainer.placement=disaggregated",
        "trainer.rollout_pool.n_gpus_per_node=1",
        "trainer.async_training.mode=stream",
        f"trainer.async_training.max_staleness={BOUND}",
        "trainer.total_training_steps=6",
        "trainer.test_freq=0",
        "trainer.save_freq=3",
        "rollout.name=vllm",
        "rollout.sampling.n=2",
        "rollout.calculate_log_probs=true",
        "actor.update.ppo_mini_batch_size=4",
        "actor.update.off_policy.mode=decoupled_ppo",
        *extra,
    ]
    result = run_recipe("recipes/gsm8k_grpo.yaml", overrides, pythonpath=files["root"])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    versions = [json.loads(line) for line in (out / "policy_versions.jsonl").read_text().splitlines()]
    return [r for r in records if "reward/mean" in r], versions


def check_within_bound(steps: list[dict], versions: list[dict]) -> None:
    staleness = [[v["trained_on"] - s for s in v["sample_versions"]] for v in versions]
    assert all(0 <= s <= BOUND for step in staleness for s in step), staleness
    assert all(len(step) == GROUPS * 2 for step in staleness)  # whole groups, train_batch_size of them
    assert [r["async/staleness_max"] for r in steps] == [max(s) for s in staleness]
    stale = [r["stream/stale_groups"] for r in steps]  # counted every step (0 where none was stale)
    totals = [r["stream/stale_groups_total"] for r in steps]  # carried over a resume
    assert [b - a for a, b in pairwise(totals)] == stale[1:] and totals[0] >= stale[0]
    assert all(0 <= r["stream/engine_busy_share"] <= 1 for r in steps)
    # groups finish within some steps (not every: a step may take groups finished before it began,
    # as the last step and the first after a resume, which takes the checkpoint's, often do)
    assert any(r["stream/engine_busy_share"] > 0 and r["stream/samples_per_s"] > 0 for r in steps)


@pytest.mark.slow
def test_streaming_grpo_trains_within_the_staleness_bound_and_resumes_within_it(local, tmp_path):  # noqa: F811
    whole = tmp_path / "whole"
    steps, versions = stream_run(local, whole)
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5, 6]
    assert [v["trained_on"] for v in versions] == [0, 1, 2, 3, 4, 5]
    check_within_bound(steps, versions)
    checkpoint = whole / "checkpoints" / "global_step_3"
    saved = torch.load(checkpoint / "rollout" / STREAM_FILE, weights_only=False)
    # after step 3's take, GROUPS groups were kept outstanding for step 4 (finished or generating)
    assert len(saved["finished"]) + len(saved["unsent"]) >= GROUPS
    resumed = tmp_path / "resumed"
    steps, versions = stream_run(local, resumed, f"trainer.resume_from_path={checkpoint}")
    assert [r["step"] for r in steps] == [4, 5, 6]
    assert [v["trained_on"] for v in versions] == [3, 4, 5]
    check_within_bound(steps, versions)
