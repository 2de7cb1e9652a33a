"""GRPO runs with off-policy corrections (algorithm.rollout_correction) run in process
(tests/recipe_runs.py) for 2 steps and log the importance weights, the parts' own metrics and the
rollout-vs-actor mismatch every step. The hf engine samples in
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
    "actor/is_ess",
)


def corrected_steps(local: dict, out, correction: list[str], extra: tuple[str, ...] = ()) -> list[dict]:
    """The metrics of 2 GRPO steps on one CPU process whose engine samples in bfloat16, under the
    `algorithm.rollout_correction.*` overrides in `correction` and the overrides in `extra`."""
    overrides = [
        *cpu_overrides(local, out, tp=1),
        "trainer.n_gpus_per_node=1",
        "trainer.test_freq=0",
        "trainer.save_freq=0",
        "rollout.sampling.n=2",
        "rollout.dtype=bfloat16",
        "rollout.calculate_log_probs=true",
        "actor.update.ppo_mini_batch_size=4",
        *(f"algorithm.rollout_correction.{setting}" for setting in correction),
        *extra,
    ]
    result = run_recipe_in_process("recipes/gsm8k_grpo.yaml", overrides, pythonpath=local["root"])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for record in steps:
        missing = [key for key in OFF_POLICY_KEYS if key not in record]
        assert not missing, f"step {record['step']} lacks {missing}"
    return steps


@pytest.mark.slow
def test_grpo_with_truncated_importance_sampling_logs_the_weights(gsm8k_local, tmp_path):
    # tight: a tiny run's ratios stay within 1.005
    steps = corrected_steps(gsm8k_local, tmp_path / "tis", ["mode=truncated_is", "upper=1.001"])
    for record in steps:
        assert record["actor/is_weight_max"] <= 1.001 + 1e-6  # truncated at C
        assert record["actor/is_clipped_frac"] > 0  # bf16 sampling: ratios up to ~1.005 measured
        assert record["actor/is_masked_frac"] == 0  # truncation never drops a token
        assert 0 < record["actor/is_ess"] <= 1 + 1e-6
        assert record["actor/rollout_actor_kl"] > 0


# bfloat16 sampling puts some token ratios beyond 1 +- 0.001 every step (see the test above) and
# none beyond 1 +- 0.005: a band of 0.001 drops tokens, a geometric mean within [0.9, 1.1] rejects
# no sequence; KPop's binary KL of a token whose ratio is 1.001 is ~1e-7, over 1e-9. A product of
# ratios equal to 1 exactly (rejection bounds 1 and 1) rejects every sequence: all weights are 0.
NEW_PARTS = {
    "sequence_tis_icepop_geometric": [
        "mode=truncated_is",
        "level=sequence",
        "upper=1.05",
        "token_mask=icepop",
        "token_mask_low=0.999",
        "token_mask_high=1.001",
        "rejection=geometric",
        "rejection_lower=0.9",
        "rejection_upper=1.1",
    ],
    "kpop_sequence_rejection": [
        "mode=none",
        "token_mask=kpop",
        "kpop_threshold=1e-9",
        "rejection=sequence",
        "rejection_lower=1.0",
        "rejection_upper=1.0",
    ],
}


@pytest.mark.slow
@pytest.mark.parametrize("parts", NEW_PARTS, ids=list(NEW_PARTS))
def test_token_masks_and_rejection_train_and_report(parts, gsm8k_local, tmp_path):
    no_kl_loss = ("actor.update.use_kl_loss=false",)  # the policy loss alone
    steps = corrected_steps(gsm8k_local, tmp_path / parts, NEW_PARTS[parts], no_kl_loss)
    everything_rejected = parts == "kpop_sequence_rejection"
    for record in steps:
        assert 0 < record["actor/token_mask_frac"] <= record["actor/is_masked_frac"], record
        assert record["actor/rejection_rate"] == (1.0 if everything_rejected else 0.0), record
        if everything_rejected:  # no token weighs anything: the policy loss is 0
            assert record["actor/is_weight_max"] == 0 and record["actor/is_ess"] == 0, record
            assert record["actor/pg_loss"] == 0, record
        else:
            assert 0 < record["actor/is_ess"] <= 1 + 1e-6, record
            assert 0 < record["actor/is_weight_max"] <= 1.05 + 1e-6, record
