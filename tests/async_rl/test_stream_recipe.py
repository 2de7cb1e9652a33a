"""mode=stream through `scripts/run_recipe.sh`: streaming GRPO (actor 1 process, vLLM rollout 1
process, max_staleness 1) killed with SIGKILL once step 4 is recorded, after its step-3 checkpoint
with groups outstanding, and restarted with the same command: it resumes and trains to step 8.
Every trained sample's staleness, read back from policy_versions.jsonl (one line per trained step,
the killed run's lines after the checkpoint dropped), is within the bound; stale groups are counted
in every step's metrics, their total carried over the resume; the checkpoint's rollout part holds
what was outstanding (finished groups, prompts to regenerate)."""

import json
from itertools import pairwise

import pytest
import torch
from gsm8k_tiny import ACTOR_AND_POOL_OF_ONE, cpu_overrides
from process_group import recipe_command, recipe_environment, run_and_kill_at_step
from recipe_runs import run_recipe_in_process

from hybridflow.trainer.rollout.stream import STREAM_FILE

BOUND, GROUPS = 1, 4  # max_staleness; data.train_batch_size (cpu_overrides)
STEPS = 8
RECIPE = "recipes/gsm8k_grpo.yaml"


def stream_overrides(files: dict, out) -> list[str]:
    """A streaming GRPO run of STEPS steps, a checkpoint every 3."""
    return [
        *cpu_overrides(files, out, tp=1),
        *ACTOR_AND_POOL_OF_ONE,
        "trainer.async_training.mode=stream",
        f"trainer.async_training.max_staleness={BOUND}",
        f"trainer.total_training_steps={STEPS}",
        "trainer.test_freq=0",
        "trainer.save_freq=3",
        "rollout.name=vllm",
        "rollout.sampling.n=2",
        "rollout.calculate_log_probs=true",
        "actor.update.ppo_mini_batch_size=4",
        "algorithm.rollout_correction.mode=decoupled_ppo",
    ]


def read_run(out) -> tuple[list[dict], list[dict]]:
    """The run's step metrics and recorded policy versions."""
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
def test_streaming_grpo_killed_after_a_checkpoint_resumes_within_the_staleness_bound(gsm8k_local, tmp_path):
    out = tmp_path / "run"
    overrides = stream_overrides(gsm8k_local, out)
    env = recipe_environment({"PYTHONPATH": str(gsm8k_local["root"])})
    command = recipe_command(RECIPE, overrides)
    run_and_kill_at_step(command, env, out / "metrics.jsonl", 4, tmp_path / "killed.log")
    # the kill lands after step 4 is recorded; on a starved machine it may land after step 6's save
    latest = (out / "checkpoints" / "latest").read_text().strip()
    assert latest in ("global_step_3", "global_step_6")
    saved = torch.load(out / "checkpoints" / latest / "rollout" / STREAM_FILE, weights_only=False)
    # after the step's take, GROUPS groups were kept outstanding for the next (finished or generating)
    assert len(saved["finished"]) + len(saved["unsent"]) >= GROUPS

    result = run_recipe_in_process(RECIPE, overrides, pythonpath=gsm8k_local["root"])  # the same run again
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    resume_step = int(latest.removeprefix("global_step_"))
    assert f"resumed from {out / 'checkpoints' / latest} at step {resume_step}" in result.stdout
    steps, versions = read_run(out)
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    assert [v["trained_on"] for v in versions] == list(range(STEPS))
    check_within_bound(steps, versions)
