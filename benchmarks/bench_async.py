"""Step time of GRPO in the `trainer.async_training` modes on the disaggregated placement.

recipes/quickstart.yaml through scripts/run_recipe.sh, changed for the placement: the Megatron
actor on 1 process (TP 1), the hf engine on 1 process of its own (`trainer.rollout_pool`), weights
transferred over gloo after every update. The tiny quickstart model is used untrained (random
init: responses seldom end early, so steps generate about RESPONSE_LENGTH tokens per row) on the
quickstart's arithmetic data, with RESPONSE_LENGTH and the batch chosen so that generation and
training (old log-probs + update) take similar time in the synchronous loop, which is where
generating ahead can save the most (docs/async.md has the measurement behind the choice).

A run's step time is the median `timing/step` over steps 2..STEPS (VLLM_STEPS on vLLM; step 1
generates synchronously in every mode); `gen` is the step's wait for its responses (in one_step /
async: what was left of the generation launched a step earlier), `train` the old log-probs plus
the actor update, `sync` the step's weight sync (generating ahead without partial rollouts, it also
waits for the launched generation to finish: a rollout process takes one call at a time). Each mode
runs ROUNDS times, the modes alternating (sync, one_step, ..., sync, one_step, ...: a change of the
machine's state lands on every mode alike, benchmarks/_conditions.py); a row gives the medians over
its runs and `step_spread`, (max - min) / median of the runs' step times. `vs_sync` is refused when
the load moved during the rounds (the load is printed before the table).

The vLLM rows (sync, one_step, stream) run on heavy-tailed response lengths (`VLLM` below), where
a whole-batch generation waits for its longest response; `vs_sync` compares each with the sync
row of its own engine. `samples_per_s` is trained samples per second of step time; `engine_busy`
the share of the step the engine generated (stream: `stream/engine_busy_share`, measured from its
calls' windows; sync: `gen` / step; one_step and async: the batch's generation / step, at most 1).

Run: `python -m benchmarks async`; `python -m benchmarks.bench_async vllm` runs the vLLM rows alone
(sync, one_step and stream on vLLM, alternating as above).
"""

import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks._conditions import LOAD_LIMIT, LoadSamples, alternating, summary
from benchmarks._timing import REPO_ROOT

TITLE = "Async RL: GRPO step time, sync vs one_step vs async vs stream (actor 1 process, rollout 1 process)"
STEPS = 8
VLLM_STEPS = 16  # the vLLM rows' heavy-tailed lengths need more steps (VLLM below)
ROUNDS = 3
RESPONSE_LENGTH = 128
PROMPTS_PER_STEP = 8  # x 8 responses = 64 sequences
MODES = {
    "sync": ["trainer.async_training.mode=sync"],
    "one_step": ["trainer.async_training.mode=one_step"],
    "async, max_staleness 2": ["trainer.async_training.mode=async", "trainer.async_training.max_staleness=2"],
}
# stream needs request-level generation: vLLM, with sync and one_step on vLLM beside it to compare,
# on heavy-tailed response lengths: the untrained model samples nearly uniformly from its 263 byte
# tokens, so six one-letter stop strings end a response after each token with probability about
# 7/263 (with EOS): lengths geometric, mean about 38 tokens, a batch of 64's longest about 150, a few
# at the limit of 256. (Not bench_megatron's log-normal: per-request limits are not a recipe setting.)
# Training packs the rows (use_dynamic_bsz), as heavy-tailed lengths call for: padded to the batch's
# longest response it took 4x the generation (5.1 s against 1.2 s, 2026-11-26), a shape where no
# overlap can save more than a fifth; packed, training and generation take similar time.
# A whole-batch step on these lengths waits for the batch's longest response, so the step time
# varies from step to step more than on the hf rows: over 7 steps the vLLM runs' medians spread by
# 10-23% and the ratio to sync moved 15% between two runs; over 15 they spread by 2-11% and three
# runs agreed within 7% (2026-11-29, docs/async.md).
VLLM = [
    f"trainer.total_training_steps={VLLM_STEPS}",  # after STEPS in the overrides: the later one wins
    "rollout.name=vllm",
    "rollout.calculate_log_probs=true",
    "algorithm.rollout_correction.mode=truncated_is",
    "actor.update.use_dynamic_bsz=true",
    "rollout.sampling.stop=[a,e,i,o,u,s]",
    "rollout.response_length=256",
]
MODES |= {
    "sync, vllm": ["trainer.async_training.mode=sync", *VLLM],
    "one_step, vllm": ["trainer.async_training.mode=one_step", *VLLM],
    "stream, max_staleness 1, vllm": ["trainer.async_training.mode=stream", *VLLM],
}


def run(modes: dict[str, list[str]] = MODES) -> list[dict]:
    from hybridflow.data.arith import write_arith_parquet
    from hybridflow.utils.tiny_model import make_tiny_model

    runs: dict[str, list[dict]] = {mode: [] for mode in modes}
    loads = LoadSamples()
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_model(Path(tmp) / "model")
        data = write_arith_parquet(Path(tmp) / "data")

        def case(mode: str):
            def step_seconds() -> float:
                out = Path(tmp) / f"run{len(runs[mode])}-{list(modes).index(mode)}"
                runs[mode].append(_step_timings(model, data, out, modes[mode]))
                return runs[mode][-1]["step_s"]

            return step_seconds

        alternating({mode: case(mode) for mode in modes}, ROUNDS, loads)
    print(f"{ROUNDS} alternating rounds; {loads.text()}", flush=True)
    return [_row(mode, runs, loads) for mode in modes]


def _row(mode: str, runs: dict[str, list[dict]], loads: LoadSamples) -> dict:
    """The medians of `mode`'s runs, its step time's spread, and its step time against the sync row
    of the same engine (none when the load moved by more than LOAD_LIMIT)."""
    medians = {key: statistics.median(t[key] for t in runs[mode]) for key in runs[mode][0]}
    spread = summary([t["step_s"] for t in runs[mode]])[1]
    sync_step = statistics.median(t["step_s"] for t in runs["sync, vllm" if "vllm" in mode else "sync"])
    moved = loads.moved()
    ratio = medians["step_s"] / sync_step
    vs_sync = ratio if moved <= LOAD_LIMIT else f"no ratio: the load moved {moved:.2f}"
    return {"mode": mode, **medians, "step_spread": spread, "vs_sync": vs_sync}


def _step_timings(model: Path, data: dict[str, Path], out: Path, extra: list[str]) -> dict[str, float]:
    """Median seconds per step (steps 2..the run's last) of one run in a fresh local Ray cluster."""
    from hybridflow.utils.tracking import read_metrics

    overrides = [
        f"model.path={model}",
        f"data.train_files=[{data['train']}]",
        f"data.val_files=[{data['test']}]",
        f"data.train_batch_size={PROMPTS_PER_STEP}",
        f"rollout.response_length={RESPONSE_LENGTH}",
        f"trainer.output_dir={out}",
        f"trainer.total_training_steps={STEPS}",
        "trainer.placement=disaggregated",
        "trainer.n_gpus_per_node=1",
        "trainer.rollout_pool.n_gpus_per_node=1",
        "actor.megatron.tensor_model_parallel_size=1",
        "actor.update.ppo_mini_batch_size=" + str(PROMPTS_PER_STEP * 8),
        "trainer.val_before_train=false",
        "trainer.test_freq=0",
        "trainer.save_freq=0",
        "trainer.export_hf=false",
        "trainer.logger=[console]",
        *extra,
    ]
    cmd = [
        "bash",
        str(REPO_ROOT / "scripts/run_recipe.sh"),
        str(REPO_ROOT / "recipes/quickstart.yaml"),
        *overrides,
    ]
    env = {**os.environ, "RAY_ADDRESS": "local", "PYTHONWARNINGS": "ignore"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"GRPO run {extra} failed:\n{(done.stdout + done.stderr)[-4000:]}")
    steps = [r for r in read_metrics(out / "metrics.jsonl") if r["step"] >= 2 and "timing/step" in r]
    step_s = statistics.median(r["timing/step"] for r in steps)
    return {
        "step_s": step_s,
        "gen_s": statistics.median(r["timing/gen"] for r in steps),
        "train_s": statistics.median(r["timing/old_log_prob"] + r["timing/update_actor"] for r in steps),
        "sync_s": statistics.median(r["timing/weight_sync"] for r in steps),
        "samples_per_s": PROMPTS_PER_STEP * 8 / step_s,  # trained
        "engine_busy": statistics.median(_engine_busy_share(r) for r in steps),
    }


def _engine_busy_share(record: dict) -> float:
    """Share of the step's wall time the engine generated: stream measures it; sync generates
    during `gen` only; generating ahead, its batch's generation (`rollout_gen`) spans the step."""
    if "stream/engine_busy_share" in record:
        return record["stream/engine_busy_share"]
    return min(1.0, record.get("timing/rollout_gen", record["timing/gen"]) / record["timing/step"])


if __name__ == "__main__":
    from benchmarks.__main__ import _format_table

    if sys.argv[1:] != ["vllm"]:
        sys.exit("usage: python -m benchmarks.bench_async vllm  (all rows: python -m benchmarks async)")
    print(_format_table(run({mode: extra for mode, extra in MODES.items() if "vllm" in mode})), flush=True)
