"""A rollout pool of two vLLM CPU processes (trainer.placement=disaggregated, actor 1 process,
through scripts/run_recipe.sh) whose processes are SIGKILLed inside a checkpoint save and inside a
weight transfer, in each async mode (sync, one_step, async with partial rollouts, stream), and a
run that goes on. The condition, not a timing: the run's processes load held_calls/sitecustomize.py,
with which a process announces a chosen call and holds it before it runs, so the kill lands inside
it.

- Inside the checkpoint save after step 1 (`save_rng_state`, the sampling positions): the other
  process's save goes through; the pool restarts the dead one with the policy's weights (checked
  against the actor's log-probs) and saves every position again.
- Inside a later weight transfer (the receiver's `load_into`, the actor's sender streaming buckets
  to both): the sender's collective fails, the survivor's receive under way fails with it and is
  dropped, the dead process is restarted and the transfer made again to both.

Every run finishes its 3 steps with 2 restarts, trains 4 whole groups of 2 samples a step, none
staler than its mode allows (policy_versions.jsonl); every step's checkpoint has both processes'
sampling positions; nothing of the run is left running. Where the samples do not depend on timing
(sync, one_step) the killed run trained exactly what an unkilled run of the same command trains:
the same metrics step by step and the same sample versions, so no sample was lost or generated
twice.
"""

import json
import os
import signal
import subprocess
import uuid
from contextlib import contextmanager
from pathlib import Path

import psutil
import pytest
from held_calls.sitecustomize import HOLD_CALLS_ENV, HOLD_DIR_ENV
from multinode_helpers import processes_with_env
from run_outputs import trained_steps
from run_processes import cleanup, wait_for
from tiny_run import command, environment, tiny_run_inputs

pytestmark = pytest.mark.slow

HELD_CALLS = Path(__file__).parent / "held_calls"  # on the run's path: its sitecustomize
STEPS = 3
OVERRIDES = (
    "trainer.placement=disaggregated", "trainer.n_gpus_per_node=1",
    "actor.megatron.tensor_model_parallel_size=1",
    "rollout.name=vllm", f"trainer.total_training_steps={STEPS}", "trainer.save_freq=1",
    "trainer.max_ckpt_to_keep=null", "trainer.export_hf=false",
    # a transfer left blocked by the death ends the run well before the test's own deadline
    "rollout.weight_transfer_timeout_s=120",
)  # fmt: skip
# the first save of each process; a process's third receive (after its first load and the
# reload of the restart at the save, the next transfer's)
HOLD = "save_rng_state:1,load_into:3"
RESTART_KEYS = (
    "rollout/engine_restarts", "rollout/restart_seconds", "rollout/restart_log_prob_diff",
    "async/weight_syncs", "weight_sync/bytes_sent", "weight_sync/bytes_full",
)  # fmt: skip


@pytest.fixture(scope="module")
def local(tmp_path_factory) -> dict:
    return tiny_run_inputs(tmp_path_factory.mktemp("pool_deaths"))


@contextmanager
def running(local: dict, out: Path, hold: Path, calls: str, *overrides: str):
    """The run, its `calls` held in `hold`; stopped with every process of it when the block ends."""
    hold.mkdir()
    marker = uuid.uuid4().hex
    env = {
        HOLD_DIR_ENV: str(hold),
        HOLD_CALLS_ENV: calls,
        "PYTHONPATH": f"{HELD_CALLS}{os.pathsep}{local['root']}",
    }
    with open(out.parent / f"{out.name}.log", "w") as log:
        proc = subprocess.Popen(
            command(local, out, *OVERRIDES, *overrides), env=environment(local, marker, **env),
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        try:
            yield proc
            assert proc.wait(timeout=900) == 0, (out.parent / f"{out.name}.log").read_text()[-4000:]
            assert processes_with_env(f"HYBRIDFLOW_TEST_RUN={marker}") == []
        finally:
            cleanup(proc, marker)


def holders(hold: Path, proc: subprocess.Popen, call: str, count: int = 1, not_pids=()) -> list[int]:
    """The pids of the first `count` processes holding `call` ("method.n"), other than `not_pids`."""
    method, number = call.split(".")
    found: list[int] = []

    def appeared() -> bool:
        found[:] = [int(p.name.split(".")[1]) for p in hold.glob(f"held-{method}.*.{number}")]
        found[:] = [pid for pid in found if pid not in not_pids]
        return len(found) >= count or proc.poll() is not None

    wait_for(appeared, 900, f"{count} rollout process(es) holding `{call}`")
    assert proc.poll() is None, f"the run ended before a rollout process held `{call}`"
    return sorted(found)


def release(hold: Path, call: str, pid: int) -> None:
    method, number = call.split(".")
    (hold / f"release-{method}.{pid}.{number}").touch()


def step_records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def without_restarts(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in RESTART_KEYS} for r in records]


KEY = "trainer.async_training"
OFF_POLICY = ("rollout.calculate_log_probs=true", "algorithm.rollout_correction.mode=decoupled_ppo")
MODES = {
    "sync": (),
    "one_step": (f"{KEY}.mode=one_step",),
    "async_partial": (
        f"{KEY}.mode=async",
        f"{KEY}.max_staleness=2",
        f"{KEY}.partial_rollout=true",
        *OFF_POLICY,
    ),
    "stream": (f"{KEY}.mode=stream", f"{KEY}.max_staleness=1", *OFF_POLICY),
}
BOUND = {"sync": 0, "one_step": 1, "async_partial": 2, "stream": 1}
CASES = [(mode, 2) for mode in MODES] + [("stream", 4)]  # (mode, rollout processes)
# where the samples do not depend on timing, the killed run must train what an unkilled one does
DETERMINISTIC = ("sync", "one_step")


def kill_inside_a_save_then_a_transfer(hold: Path, proc: subprocess.Popen, processes: int) -> None:
    first, *others = holders(hold, proc, "save_rng_state.1", count=processes)
    psutil.Process(first).send_signal(signal.SIGKILL)
    for pid in others:  # their saves go through
        release(hold, "save_rng_state.1", pid)
    (restarted,) = holders(hold, proc, "save_rng_state.1", not_pids=(first, *others))
    release(hold, "save_rng_state.1", restarted)  # the positions saved again, the new process's too
    receiving = holders(hold, proc, "load_into.3")[0]
    psutil.Process(receiving).send_signal(signal.SIGKILL)
    (hold / "release").touch()  # every call from now on goes through


@pytest.mark.parametrize(("mode", "processes"), CASES, ids=[f"{m}-pool_of_{n}" for m, n in CASES])
def test_processes_killed_inside_a_save_and_a_transfer_are_restarted_and_the_run_trains_on(
    local, tmp_path, mode, processes
):
    killed, hold = tmp_path / "killed", tmp_path / "hold"
    pool = (f"trainer.rollout_pool.n_gpus_per_node={processes}", *MODES[mode])
    with running(local, killed, hold, HOLD, *pool) as proc:
        kill_inside_a_save_then_a_transfer(hold, proc, processes)
    records = step_records(killed)
    assert [r["rollout/engine_restarts"] for r in records] == [0, 1, 2]
    assert all(r.get("rollout/restart_log_prob_diff", 0.0) <= 1e-4 for r in records)
    for step in range(1, STEPS + 1):  # each step's checkpoint holds every process's position
        rollout = killed / "checkpoints" / f"global_step_{step}" / "rollout"
        assert sorted(p.name for p in rollout.glob("rank_*.pt")) == [f"rank_{r}.pt" for r in range(processes)]
    versions = [json.loads(line) for line in (killed / "policy_versions.jsonl").read_text().splitlines()]
    assert [v["trained_on"] for v in versions] == list(range(STEPS))
    assert [len(v["sample_versions"]) for v in versions] == [8] * STEPS  # 4 whole groups of 2 a step
    staleness = [v["trained_on"] - s for v in versions for s in v["sample_versions"]]
    assert all(0 <= s <= BOUND[mode] for s in staleness), versions
    if mode in DETERMINISTIC:
        plain = tmp_path / "plain"
        with running(local, plain, tmp_path / "plain_hold", "", *pool):
            pass
        assert without_restarts(trained_steps(killed)) == without_restarts(trained_steps(plain))
        assert (killed / "policy_versions.jsonl").read_text() == (plain / "policy_versions.jsonl").read_text()
