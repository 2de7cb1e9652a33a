"""DAPO's dynamic sampling in the asynchronous modes, run in process (tests/recipe_runs.py): the DAPO
recipe made tiny (actor 1 process, vLLM rollout 1 process, 4 prompt groups of 2 a step) for 2 steps
in async (max_staleness 2) and stream (max_staleness 1) (one_step is async at depth 1: its refill
rounds are tests/async_rl/test_dynamic_sampling_ahead.py's), with a reward under which every
prompt whose answer is even gets one score for all its responses (its group is dropped), the others
a score per response (the response's length in characters, which differs between samples).

Every step trains a full batch (4 groups of 2 samples, read back from policy_versions.jsonl), no
sample staler than the mode allows; the dropped groups and the rounds it took are counted in the
step's metrics, and the first steps drop some (the loader's first batches hold even answers)."""

import json

import pytest
from gsm8k_tiny import ACTOR_AND_POOL_OF_ONE, cpu_overrides
from recipe_runs import run_recipe_in_process

GROUPS, N = 4, 2  # data.train_batch_size (cpu_overrides), rollout.sampling.n

PARITY_REWARD = """
def even_answers_alike(data_source, solution_str, ground_truth, extra_info):
    # every response to a prompt whose answer ends in an even digit scores the same
    if ground_truth.strip()[-1] in "02468":
        return 0.0
    return float(len(solution_str))
"""


@pytest.mark.slow
@pytest.mark.parametrize(
    ("mode", "bound"),
    [
        (["trainer.async_training.mode=async", "trainer.async_training.max_staleness=2"], 2),
        (["trainer.async_training.mode=stream", "trainer.async_training.max_staleness=1"], 1),
    ],
    ids=["async-max_staleness-2", "stream"],
)
def test_dynamic_sampling_refills_the_batch_in_async_modes(gsm8k_local, tmp_path, mode, bound):
    (tmp_path / "parity_reward.py").write_text(PARITY_REWARD)
    out = tmp_path / "run"
    overrides = [
        *cpu_overrides(gsm8k_local, out, tp=1),
        *mode,
        *ACTOR_AND_POOL_OF_ONE,
        "trainer.test_freq=0",
        "trainer.save_freq=0",
        "rollout.name=vllm",
        f"rollout.sampling.n={N}",
        "actor.update.ppo_mini_batch_size=4",
        "reward.custom_fn=parity_reward.even_answers_alike",
        "algorithm.filter_groups.max_num_gen_batches=8",
        "algorithm.overlong_buffer.enable=false",  # its penalty would tell an even answer's samples apart
    ]
    pythonpath = [gsm8k_local["root"], tmp_path]
    result = run_recipe_in_process("recipes/gsm8k_dapo.yaml", overrides, pythonpath=pythonpath)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    versions = [json.loads(line) for line in (out / "policy_versions.jsonl").read_text().splitlines()]
    assert [v["trained_on"] for v in versions] == [0, 1]
    for v in versions:  # a full batch, each sample stamped with a version within the bound
        assert len(v["sample_versions"]) == GROUPS * N
        assert all(0 <= v["trained_on"] - s <= bound for s in v["sample_versions"]), v
    for r in steps:
        generated, dropped = r["dynamic_sampling/generated_groups"], r["dynamic_sampling/dropped_groups"]
        assert generated == GROUPS * r["dynamic_sampling/gen_batches"]  # each round a batch's groups
        assert r["dynamic_sampling/dropped_group_share"] == pytest.approx(dropped / generated)
        assert generated - dropped >= GROUPS
    assert sum(r["dynamic_sampling/dropped_groups"] for r in steps) > 0
    assert max(r["dynamic_sampling/gen_batches"] for r in steps) >= 2  # a refill round ran
