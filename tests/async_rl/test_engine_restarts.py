"""A rollout process on the real vLLM CPU engine (trainer.placement=disaggregated, actor 1 process,
vLLM 1 process, through scripts/run_recipe.sh) killed with SIGKILL while a generation call is in
flight. The condition, not a timing: the run's processes load held_calls/sitecustomize.py, with
which the rollout worker announces a chosen generation call once it has generated its tokens and
holds the call there until the test releases it, so the kill lands with the call unanswered.

- Killed once, at step 2 (policy version 1): the pool restarts the process, checks the fresh
  engine's log-probs of fixed tokens against the actor's (within 1e-4), generates the lost call
  again with its seed, and the run finishes its 3 steps having trained exactly what an unkilled
  run trains (the same samples, step by step: the same metrics and sample versions). The unkilled
  run is the reference only, so it runs in the test's own process (tests/recipe_runs.py).
- The same in trainer.async_training.mode=stream (one generation call per group, several in flight
  on the process): killed while its first call holds its tokens, the lost groups are generated
  again on the restarted process, and the run trains its 3 steps of whole groups within the
  staleness bound.
- Killed once more than rollout.max_engine_restarts: exit status 1, one `error:` line naming the
  process, the call and the limit, no traceback, no process of the run left, no checkpoint.
"""

import json
import subprocess
import uuid
from contextlib import contextmanager
from pathlib import Path

import pytest
from held_calls.control import held_environment, held_generation, kill, release
from multinode_helpers import processes_with_env
from recipe_runs import run_recipe_in_process
from run_outputs import step_records, trained_steps, without_restarts
from run_processes import cleanup
from tiny_run import RECIPE, command, environment, overrides, tiny_run_inputs

pytestmark = pytest.mark.slow

OVERRIDES = (
    "trainer.placement=disaggregated", "trainer.n_gpus_per_node=1",
    "actor.megatron.tensor_model_parallel_size=1", "trainer.rollout_pool.n_gpus_per_node=1",
    "rollout.name=vllm", "trainer.total_training_steps=3", "trainer.save_freq=0", "trainer.export_hf=false",
)  # fmt: skip


@pytest.fixture(scope="module")
def local(tmp_path_factory) -> dict:
    return tiny_run_inputs(tmp_path_factory.mktemp("restarts"))


def start(local: dict, out: Path, hold: Path, calls: str, marker: str, *overrides: str) -> subprocess.Popen:
    hold.mkdir()
    log = open(out.parent / f"{out.name}.log", "w")  # noqa: SIM115 - the run's, closed with it
    return subprocess.Popen(
        command(local, out, *OVERRIDES, *overrides),
        env=environment(local, marker, **held_environment(hold, generation_calls(calls), local["root"])),
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip


def generation_calls(calls: str) -> str:
    """The hook's spec for holding each rollout process's generation calls numbered `calls` (e.g.
    "1,2", or "every")."""
    return ",".join(f"generate_sequences:{n}" for n in filter(None, calls.split(",")))


@contextmanager
def running(local: dict, out: Path, hold: Path, calls: str, marker: str, *overrides: str):
    """The run, started; stopped with every process of it when the block ends, however it ends."""
    proc = start(local, out, hold, calls, marker, *overrides)
    try:
        yield proc
    finally:
        cleanup(proc, marker)


def finishes(proc: subprocess.Popen, hold: Path, out: Path) -> None:
    """Every call held from now on goes through (a restarted process's too); the run succeeds."""
    (hold / "release").touch()
    assert proc.wait(timeout=900) == 0, output_of(out)[-4000:]


def output_of(out: Path) -> str:
    return (out.parent / f"{out.name}.log").read_text()


def test_a_rollout_process_killed_mid_generation_is_restarted_and_the_run_trains_the_same(
    local, ray_cluster, tmp_path
):
    killed, hold, marker = tmp_path / "killed", tmp_path / "hold", uuid.uuid4().hex
    with running(local, killed, hold, "1,2", marker) as proc:
        pid, _ = held_generation(hold, proc, "1")  # step 1's generation: let it go
        release(hold, "generate_sequences.1", pid)
        assert held_generation(hold, proc, "2")[0] == pid  # step 2's, with policy version 1: killed
        kill(pid)
        finishes(proc, hold, killed)
    records = step_records(killed)
    assert [r["rollout/engine_restarts"] for r in records] == [0, 1, 1]
    assert records[1]["rollout/restart_log_prob_diff"] <= 1e-4  # the fresh engine serves version 1
    plain = tmp_path / "plain"  # the unkilled run, in this process: its subject is not a process
    done = run_recipe_in_process(RECIPE, overrides(local, plain, *OVERRIDES), pythonpath=local["root"])
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    seconds = [json.loads(line)["timing/step"] for line in (plain / "metrics.jsonl").read_text().splitlines()]
    restart = records[1]
    print(
        f"restart {restart['rollout/restart_seconds']:.1f} s, diff {restart['rollout/restart_log_prob_diff']}"
    )
    print(
        f"steps {[round(r['timing/step'], 1) for r in records]} s, unkilled {[round(t, 1) for t in seconds]}"
    )
    assert without_restarts(trained_steps(killed)) == without_restarts(trained_steps(plain))
    syncs = [[r["async/weight_syncs"] for r in step_records(run)] for run in (killed, plain)]
    assert syncs[0] == [n + (step == 1) for step, n in enumerate(syncs[1])], syncs  # + step 2's restart
    sent = [[r["weight_sync/bytes_sent"] for r in step_records(run)] for run in (killed, plain)]
    assert sent[0] == [n * (1 + (step == 1)) for step, n in enumerate(sent[1])], sent  # one full load more
    versions = (killed / "policy_versions.jsonl").read_text()
    assert versions == (plain / "policy_versions.jsonl").read_text()
    assert [len(json.loads(line)["sample_versions"]) for line in versions.splitlines()] == [8, 8, 8]


def test_in_stream_mode_a_killed_rollout_process_is_restarted_and_the_lost_groups_generated_again(
    local, tmp_path
):
    out, hold, marker = tmp_path / "stream", tmp_path / "hold", uuid.uuid4().hex
    stream = (
        "trainer.async_training.mode=stream", "trainer.async_training.max_staleness=1",
        "rollout.calculate_log_probs=true", "algorithm.rollout_correction.mode=decoupled_ppo",
    )  # fmt: skip
    # every call held: the step cannot fill with the other groups before the lost one is met
    with running(local, out, hold, "every", marker, *stream) as proc:
        kill(held_generation(hold, proc, "1")[0])  # a group's tokens generated, its call unanswered
        finishes(proc, hold, out)
    records = step_records(out)
    assert [r["rollout/engine_restarts"] for r in records] == [1, 1, 1]
    assert records[0]["rollout/restart_log_prob_diff"] <= 1e-4  # the fresh engine serves version 0
    versions = [json.loads(line) for line in (out / "policy_versions.jsonl").read_text().splitlines()]
    # as many samples as an unkilled run trains: train_batch_size whole groups of 2 every step
    assert [len(v["sample_versions"]) for v in versions] == [8, 8, 8]
    assert all(0 <= v["trained_on"] - s <= 1 for v in versions for s in v["sample_versions"]), versions


def test_killed_once_more_than_max_engine_restarts_ends_the_run_with_one_named_error(local, tmp_path):
    out, hold, marker = tmp_path / "run", tmp_path / "hold", uuid.uuid4().hex
    overrides = ("rollout.max_engine_restarts=1", "trainer.save_freq=1")
    with running(local, out, hold, "1", marker, *overrides) as proc:
        first, _ = held_generation(hold, proc, "1")
        kill(first)  # restarted: the lost call is generated again on the new process, and held
        kill(held_generation(hold, proc, "1", not_pids=(first,))[0])
        assert proc.wait(timeout=900) == 1, output_of(out)[-4000:]
        output = output_of(out)
        assert "Traceback" not in output, output[-4000:]
        last = output.rstrip().splitlines()[-1]
        assert last.startswith("error: rollout pool process 0 died during `generate_sequences` ("), last
        assert "1 restart(s) before, rollout.max_engine_restarts=1; rerun the same command" in last
        assert processes_with_env(f"HYBRIDFLOW_TEST_RUN={marker}") == []
        checkpoints = out / "checkpoints"
        assert not checkpoints.exists() or not any(checkpoints.iterdir())  # nothing, half-written or not
