"""A one_step run resumed from its step-1 checkpoint trains as the uninterrupted run does: the
batch generating at the save is finished and saved with the checkpoint (not discarded), the
rollout engine's sampling position and the policy version come back, and steps 2-3 log the same
numbers and end with bit-identical weights. Actor 1 process, vLLM rollout 1 process."""

import pytest
from gsm8k_tiny import ACTOR_AND_POOL_OF_ONE, cpu_overrides
from recipe_runs import run_recipe_in_process
from run_outputs import exported, trained_steps


def one_step_run(files: dict, out, *extra: str) -> None:
    overrides = [
        *cpu_overrides(files, out, tp=1),
        *ACTOR_AND_POOL_OF_ONE,
        "trainer.async_training.mode=one_step",
        "trainer.total_training_steps=3",
        "trainer.test_freq=0",
        "trainer.save_freq=1",
        "trainer.export_hf=true",
        "rollout.name=vllm",
        "rollout.sampling.n=2",
        "actor.update.ppo_mini_batch_size=4",
        *extra,
    ]
    result = run_recipe_in_process("recipes/gsm8k_grpo.yaml", overrides, pythonpath=files["root"])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]


@pytest.mark.slow
def test_resumed_one_step_run_equals_the_uninterrupted_one(gsm8k_local, tmp_path):
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    one_step_run(gsm8k_local, whole)
    checkpoint = whole / "checkpoints" / "global_step_1"
    assert (checkpoint / "rollout" / "generation_ahead.pt").is_file()
    one_step_run(gsm8k_local, resumed, f"trainer.resume_from_path={checkpoint}")
    whole_steps, resumed_steps = ({r["step"]: r for r in trained_steps(out)} for out in (whole, resumed))
    assert sorted(resumed_steps) == [2, 3]
    assert resumed_steps == {step: whole_steps[step] for step in (2, 3)}
    whole_versions = (whole / "policy_versions.jsonl").read_text().splitlines()
    assert (resumed / "policy_versions.jsonl").read_text().splitlines() == whole_versions[1:]
    weights, expected = exported(resumed), exported(whole)
    assert weights.keys() == expected.keys()
    assert all(bool((weights[name] == expected[name]).all()) for name in expected)
