"""A GRPO run with an off-policy correction runs in process (tests/recipe_runs.py) for 2 steps and
logs the importance weights and the rollout-vs-actor mismatch every step. The hf engine samples in
bfloat16 while the actor trains in float32, so the engine's log-probs really differ from the
actor's (as kernels and precision make them differ on GPUs)."""

import json

import pytest
from gsm8k_tiny import cpu_overrides
from recipe_runs import run_recipe_in_process

OFF_POLICY_KEYS = (
    "actor/is_weight_mean",
    "actor/is_weight_max",
    "actor/is_clipped_frac",
    "actor/is_masked_frac",
    "actor/rollout_actor_kl",
)


@pytest.mark.slow
def test_grpo_with_truncated_importance_sampling_logs_the_weights(gsm8k_local, tmp_path):
    out = tmp_path / "tis"
    overrides = [
        *cpu_overrides(gsm8k_local, out, tp=1),
        "trainer.n_gpus_per_node=1",
        "trainer.test_freq=0",
        "trainer.save_freq=0",
        "rollout.sampling.n=2",
        "rollout.dtype=bfloat16",
        "rollout.calculate_log_probs=true",
        "actor.update.ppo_mini_batch_size=4",
        "algorithm.rollout_correction.mode=truncated_is",
        "algorithm.rollout_correction.upper=1.001",  # tight: a tiny run's ratios stay within 1.005
    ]
    result = run_recipe_in_process("recipes/gsm8k_grpo.yaml", overrides, pythonpath=gsm8k_local["root"])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for record in steps:
        missing = [key for key in OFF_POLICY_KEYS if key not in record]
        assert not missing, f"step {record['step']} lacks {missing}"
        assert record["actor/is_weight_max"] <= 1.001 + 1e-6  # truncated at C
        assert record["actor/is_clipped_frac"] > 0  # bf16 sampling: ratios up to ~1.005 measured
        assert record["actor/is_masked_frac"] == 0  # truncation never drops a token
        assert record["actor/rollout_actor_kl"] > 0
