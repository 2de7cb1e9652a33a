"""The README's learning claim, checked: GRPO raises held-out accuracy above its SFT warm start,
with full weights, with LoRA adapters (issue 26), in one_step mode (issue 22: each batch
generated on the rollout's own process with the weights one update older; docs/async.md) and in
stream mode (issue 36: groups generated on their own, steps taking the next finished ones).

Stage 1 is the warm start stored once per session (`quickstart_warm_start`, tests/conftest.py:
the quickstart's model, data and SFT stage). Stage 2 is recipes/quickstart.yaml through
scripts/run_recipe.sh, unchanged but for the paths, 20 steps instead of 80, validation
at the last step only and no checkpoints or export. Held-out
accuracy is `val/accuracy` in metrics.jsonl: greedy answers to the 200 test problems, scored by
the rule reward, at RL step 0 (the warm start) and at the last step.

Measured with exactly this configuration (runs are deterministic on CPU), step 0 -> step 20:
  the recipe's seeds (data.seed=1, rollout.seed=42; what this test runs): 36.5% -> 65.5% (+29.0)
  data.seed=1 rollout.seed=1: 36.5% -> 63.0% (+26.5 points)
  data.seed=2 rollout.seed=2: 36.5% -> 56.0% (+19.5 points)
  data.seed=3 rollout.seed=3: 36.5% -> 53.0% (+16.5 points)
Runs validating every 5 steps (another sampling trajectory) gained +27.5, +15.5 and +14.0 points
by step 20 (seeds 1/42, 2/2, 3/3). The margin, 8 points (tests/learning_runs.py), is under every
gain measured, with at least 6 points to spare; 10 steps gained only +10 in some runs.
docs/quickstart-results.md has the runs.
"""

import pytest
from learning_runs import STEPS, check_accuracy_rises, run_from_warm_start

# LoRA on every linear (rank 16, alpha 32) at 10x the full-weight lr, as adapters usually need;
# measured from the same warm start: 42.0% -> 61.5% (+19.5 points) in 20 steps (2026-11-24)
LORA = ["actor.lora.rank=16", "actor.lora.alpha=32", "actor.optim.lr=2e-3"]
# one_step (docs/async.md): the actor on 1 process, the hf engine on 1 of its own generating each
# batch with the weights one update older than those trained, at the quickstart's own lr (2e-4),
# with truncated importance sampling (weights min(pi_old / mu, 2)): without a correction one update
# at this lr moves this tiny policy too far for a gradient on the previous policy's samples
# (42.0% -> 21.5%). Measured from the same warm start, seeds 1/42 (this test), 2/2, 3/3:
# 42.0% -> 62.5%, 52.5%, 51.0% (+20.5, +10.5, +9.0 points) in 20 steps (2026-11-24; 62.5% again
# on the code of partial rollouts). At lr 1e-4 with decoupled PPO: +27.0, +25.0, +26.0.
ONE_STEP = [
    "trainer.placement=disaggregated",
    "trainer.n_gpus_per_node=1",
    "trainer.rollout_pool.n_gpus_per_node=1",
    "actor.megatron.tensor_model_parallel_size=1",
    "trainer.async_training.mode=one_step",
    "rollout.calculate_log_probs=true",
    "actor.update.off_policy.mode=truncated_is",
    "actor.update.off_policy.upper=2",
]

# stream (docs/async.md): the same placement with the vLLM engine, each prompt's group generating on
# its own and a step training the next finished groups, at most 1 version old (stale ones dropped),
# at half the quickstart's lr with decoupled PPO (Fu et al. 2025, AReaL), the setting under which
# one_step gained 25-27 points at every seed measured. Runs are not reproducible (step 1 takes the
# first 32 of the 64 groups submitted, by timing), so the margin was measured over repeated runs:
# from the same warm start (2026-11-26, the 2-core machine, one run beside another at times),
# seeds 1/42: 36.5% -> 60.5%, 63.0%, 58.0% (+24.0, +26.5, +21.5) in three runs; 2/2: 60.5% (+24.0);
# 3/3: 56.5% (+20.0). With one_step's settings (lr 2e-4, truncated_is) the gain was -0.5 to +10.5
# points at seeds 1/42 (five runs): below the margin too often to test.
STREAM = [
    *ONE_STEP[:4],
    "trainer.async_training.mode=stream",
    "rollout.name=vllm",
    "rollout.calculate_log_probs=true",
    "actor.update.off_policy.mode=decoupled_ppo",
    "actor.update.off_policy.upper=2",
    "actor.optim.lr=1e-4",
]


def run_grpo(warm_start, out, extra: list[str]) -> list[dict]:
    return run_from_warm_start("recipes/quickstart.yaml", warm_start, out, extra)


@pytest.mark.slow
def test_grpo_raises_held_out_accuracy_over_the_sft_warm_start(quickstart_warm_start, tmp_path):
    check_accuracy_rises(run_grpo(quickstart_warm_start, tmp_path / "grpo", []))


@pytest.mark.slow
def test_grpo_with_lora_raises_held_out_accuracy_too(quickstart_warm_start, tmp_path):
    records = run_grpo(quickstart_warm_start, tmp_path / "grpo_lora", LORA)
    check_accuracy_rises(records)
    counts = next(r for r in records if "actor/trainable_params" in r)
    trainable, total = counts["actor/trainable_params"], counts["actor/total_params"]
    assert 0 < trainable < 0.25 * total, counts  # adapters only
    assert 0 < counts["actor/optimizer_state_bytes"] <= 8 * trainable, counts  # Adam's two moments


@pytest.mark.slow
def test_one_step_grpo_raises_held_out_accuracy_too(quickstart_warm_start, tmp_path):
    records = run_grpo(quickstart_warm_start, tmp_path / "grpo_one_step", ONE_STEP)
    check_accuracy_rises(records)
    staleness = [r["async/staleness_mean"] for r in records if "reward/mean" in r]
    assert staleness == [0.0] + [1.0] * (STEPS - 1)  # trained on samples one update old


@pytest.mark.slow
def test_streaming_grpo_raises_held_out_accuracy_too(quickstart_warm_start, tmp_path):
    records = run_grpo(quickstart_warm_start, tmp_path / "grpo_stream", STREAM)
    check_accuracy_rises(records)
    steps = [r for r in records if "reward/mean" in r]
    assert all(r["async/staleness_max"] <= 1 for r in steps)  # within the bound, stale groups dropped
    assert all("stream/stale_groups" in r for r in steps)
