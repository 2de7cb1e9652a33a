"""recipes/gsm8k_tool_grpo.yaml on a rollout pool of two vLLM replicas (trainer.placement=
disaggregated): the tool loops run on the driver and the router sends each turn to a replica
(hybridflow/trainer/rollout/routed.py). The tiny model is fitted to a 3-turn calculator
conversation (tool_model.py), sampled at a low temperature: every trajectory has 3 turns, and the
4 sessions of a step (2 prompts x 2 samples, all the same prompt) spread 2 and 2 over the replicas.

Step 1: each replica's third request (a session's second turn) is held (tests/async_rl/held_calls),
one replica's process is killed there, and the run goes on: the router's record shows that
replica's sessions moved to the other (their lost turn asked again there, `moved`), and the pool
restarted it once the step's trajectories ended. Step 2: both replicas serve again, and every
session's turns stay on one replica. Every step logs the prefix-cache hit rate (the third turn's
prompt holds a whole 128-token block of the second's) and each replica's share."""

import json
import subprocess
import sys
import uuid
from collections import defaultdict
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tool_model import ANSWER, QUESTION

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "async_rl"))
from held_calls.control import held_environment, holders, kill, release
from multinode_helpers import processes_with_env
from run_processes import cleanup
from tiny_run import environment

ROOT = Path(__file__).resolve().parents[2]
PROMPTS, N = 2, 2


def write_rows(path: Path) -> str:
    row = {
        "prompt": [{"role": "user", "content": QUESTION}],
        "data_source": "openai/gsm8k",
        "reward_model": {"ground_truth": ANSWER},
    }
    pq.write_table(pa.Table.from_pylist([row] * 8), path)
    return str(path)


def command(model: Path, data: str, out: Path) -> list[str]:
    overrides = [
        f"model.path={model}", f"data.train_files=[{data}]", "data.val_files=[]",
        "data.max_prompt_length=64", f"data.train_batch_size={PROMPTS}",
        "actor.megatron.tensor_model_parallel_size=1", "actor.megatron.params_dtype=float32",
        "actor.update.use_dynamic_bsz=false", "actor.update.ppo_mini_batch_size=4",
        "actor.update.ppo_micro_batch_size=2", "actor.log_prob_micro_batch_size=2",
        "ref.log_prob_micro_batch_size=2",
        "rollout.dtype=float32", "rollout.response_length=200", f"rollout.sampling.n={N}",
        "rollout.sampling.temperature=0.05",  # the fitted turns, every time
        "trainer.use_gpu=false", "trainer.placement=disaggregated", "trainer.n_gpus_per_node=1",
        "trainer.rollout_pool.n_gpus_per_node=2", "trainer.total_training_steps=2",
        "trainer.val_before_train=false", "trainer.test_freq=0", "trainer.save_freq=0",
        "trainer.logger=[console]", f"trainer.output_dir={out}",
    ]  # fmt: skip
    return [
        "bash",
        str(ROOT / "scripts/run_recipe.sh"),
        str(ROOT / "recipes/gsm8k_tool_grpo.yaml"),
        *overrides,
    ]


@pytest.mark.slow
def test_a_replica_killed_mid_trajectory_moves_its_sessions_and_the_run_goes_on(tool_model, tmp_path):
    data, out, hold = write_rows(tmp_path / "train.parquet"), tmp_path / "out", tmp_path / "hold"
    hold.mkdir()
    marker = uuid.uuid4().hex
    env = environment({"root": tmp_path}, marker, **held_environment(hold, "generate_request:3", tmp_path))
    log = tmp_path / "run.log"
    with open(log, "w") as sink:
        proc = subprocess.Popen(
            command(tool_model, data, out),
            env=env,
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        killed, survivor = holders(hold, proc, "generate_request.3", count=2)
        kill(killed)
        release(hold, "generate_request.3", survivor)
        (hold / "release").touch()  # the restarted process's third request goes through
        assert proc.wait(timeout=900) == 0, log.read_text()[-6000:]
        assert processes_with_env(f"HYBRIDFLOW_TEST_RUN={marker}") == []
    finally:
        cleanup(proc, marker)
    routes = [json.loads(line) for line in (out / "router.jsonl").read_text().splitlines()]
    sessions = defaultdict(list)
    for route in routes:
        sessions[route["session"]].append(route)
    calls = sorted({int(name.split("-")[0]) for name in sessions})  # each named "<call's seed>-<row>"
    rows = [[f"{call}-{row}" for row in range(PROMPTS * N)] for call in calls]
    assert len(calls) == 2 and sorted(sessions) == sorted(rows[0] + rows[1]), routes
    first, second = rows  # steps 1 and 2
    moved = [name for name in first if any(route["moved"] for route in sessions[name])]
    assert moved, routes  # the killed replica's sessions went on elsewhere
    for name in sessions:
        replicas = [route["replica"] for route in sessions[name]]
        assert sorted({route["turn"] for route in sessions[name]}) == [0, 1, 2], routes
        if name in moved:  # on the killed replica up to the move, on the other one from it
            at = next(i for i, route in enumerate(sessions[name]) if route["moved"])
            assert len(set(replicas[:at])) == 1 and set(replicas[at:]) == {1 - replicas[0]}, routes
        else:  # every turn on one replica, each asked once
            assert len(set(replicas)) == 1 and len(replicas) == 3, routes
    assert not set(moved) & set(second) and {sessions[name][0]["replica"] for name in second} == {0, 1}
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert [r["rollout/engine_restarts"] for r in steps] == [1, 1]
    assert steps[0]["rollout/router/moved_turns"] >= 1 and steps[1]["rollout/router/moved_turns"] == 0
    assert all(r["agent/turns/mean"] == 3 and r["agent/tool_calls/mean"] == 2 for r in steps), steps
    assert all(r["rollout/prefix_cache_hit_rate"] > 0 for r in steps), steps
    shares = [r["rollout/replica_0/samples"] + r["rollout/replica_1/samples"] for r in steps[1:]]
    assert shares == [PROMPTS * N]
