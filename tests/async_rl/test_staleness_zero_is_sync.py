"""GRPO with the rollout on its own pool (trainer.placement=disaggregated: actor 1 process, vLLM
rollout 1 process, 2 steps in process, tests/recipe_runs.py): the synchronous run trains every
sample at the version that generated it, and async mode with max_staleness 0 is that run bit for
bit (verl#6780 reports theirs is not): the same numbers, sample versions and exported weights."""

import json

import pytest
from gsm8k_tiny import ACTOR_AND_POOL_OF_ONE, cpu_overrides
from recipe_runs import run_recipe_in_process
from run_outputs import exported, trained_steps


def run(files: dict, out, *mode: str) -> None:
    overrides = [
        *cpu_overrides(files, out, tp=1),
        *mode,
        *ACTOR_AND_POOL_OF_ONE,
        "trainer.test_freq=0",
        "trainer.save_freq=0",
        "trainer.export_hf=true",
        "rollout.name=vllm",
        "rollout.sampling.n=2",
        "actor.update.ppo_mini_batch_size=4",
    ]
    result = run_recipe_in_process("recipes/gsm8k_grpo.yaml", overrides, pythonpath=files["root"])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]


@pytest.mark.slow
def test_async_with_max_staleness_zero_equals_sync_bit_for_bit(gsm8k_local, tmp_path):
    sync, zero = tmp_path / "sync", tmp_path / "async0"
    run(gsm8k_local, sync)
    run(gsm8k_local, zero, "trainer.async_training.mode=async", "trainer.async_training.max_staleness=0")
    steps = trained_steps(sync)
    assert [r["step"] for r in steps] == [1, 2]
    assert steps[1]["kl/mean"] != 0  # step 2 sampled from the updated policy, moved off the reference
    versions = [json.loads(line) for line in (sync / "policy_versions.jsonl").read_text().splitlines()]
    assert versions == [{"trained_on": v, "sample_versions": [v] * 8} for v in (0, 1)]  # 4 prompts x 2
    assert trained_steps(zero) == trained_steps(sync)
    assert (zero / "policy_versions.jsonl").read_text() == (sync / "policy_versions.jsonl").read_text()
    weights, expected = exported(zero), exported(sync)
    assert weights.keys() == expected.keys()
    assert all(torch_equal(weights[name], expected[name]) for name in expected)


def torch_equal(a, b) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and bool((a == b).all())
