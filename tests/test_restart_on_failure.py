"""trainer.restart_on_failure: a worker process that dies restarts the run from its newest checkpoint.

Unit tests of hybridflow/trainer/restart.py (no Ray cluster: Ray's error types are built by hand):
which errors restart (a process's death, seen through a worker-group call or a failed save it
caused) and which never do (an exception raised in a worker, a refused step, a bad recipe, an
actor whose constructor raised), the count, the one-line error when none is left, where a restart
resumes from (this run's newest checkpoint, else where the run started, with the driver's random
state of then), and the warning for restarts without checkpoints.

End to end through scripts/run_recipe.sh (colocated GRPO, tiny model, hf rollout, one process):
the policy worker killed with SIGKILL once the checkpoint of step 2 is published; with one restart
allowed the run resumes from its checkpoint and ends with every step's metrics and status 0, with
none it ends with one `error:` line naming the process; no process of the run is left either way.
"""

import random
import re
import subprocess
import uuid
from pathlib import Path

import psutil
import pytest
import ray.exceptions
from multinode_helpers import processes_with_env
from run_processes import actor_processes, as_from_a_terminal, cleanup, wait_for
from tiny_run import command, environment, tiny_run_inputs

from hybridflow.checks.recipe import RecipeError
from hybridflow.checks.resume import warn_if_restarts_start_over
from hybridflow.config.loader import to_dict
from hybridflow.config.schema import RecipeConfig
from hybridflow.single_controller.errors import worker_error
from hybridflow.trainer.checkpoint import CheckpointManager, CheckpointSaveError, save_trainer_state
from hybridflow.trainer.restart import Restarts, WorkerProcessDied
from hybridflow.utils.nonfinite import NonFiniteError
from hybridflow.utils.tracking import read_metrics

DEATH = (
    "The actor died unexpectedly before finishing this task.\n\tclass_name: HybridPolicyWorker\n"
    "\tactor_id: 0123abcd\n\tpid: 4242\n\tip: 127.0.0.1"
)


def died() -> ray.exceptions.ActorDiedError:
    err = ray.exceptions.ActorDiedError()
    err.error_msg = DEATH  # what Ray writes from a dead actor's context (protobuf, not built here)
    return err


def recipe(tmp_path: Path, allowed: int, **trainer) -> RecipeConfig:
    cfg = RecipeConfig()
    cfg.trainer.output_dir, cfg.trainer.restart_on_failure = str(tmp_path / "run"), allowed
    for key, value in trainer.items():
        setattr(cfg.trainer, key, value)
    return cfg


def raised_from(outer: BaseException, inner: BaseException) -> BaseException:
    outer.__cause__ = inner
    return outer


def in_the_worker(err: BaseException) -> BaseException:
    """What a worker-group call raises on the driver when the worker's method raised `err`."""
    return worker_error(
        ray.exceptions.RayTaskError("update_actor", "worker traceback", err), 0, "update_actor"
    )


RESTARTS = {
    "a worker-group call to a dead process": (lambda: worker_error(died(), 0, "policy_update_actor"), True),
    "Ray's own error (a future's get)": (died, True),
    "a checkpoint save a dead process failed": (
        lambda: raised_from(
            CheckpointSaveError("step 3: saving failed"), worker_error(died(), 0, "policy_save")
        ),
        True,
    ),
    "a worker that crashed in a task": (ray.exceptions.WorkerCrashedError, True),
    "an exception raised in the worker": (lambda: in_the_worker(ValueError("bad batch")), False),
    "an actor whose constructor raised": (
        lambda: ray.exceptions.RayActorError(actor_init_failed=True),
        False,
    ),
    "a refused step": (lambda: NonFiniteError("step 2: reward nan"), False),
    "a bad recipe": (lambda: RecipeError(["trainer.save_freq must be >= 0, got -1"]), False),
    "a plain Python error on the driver": (lambda: KeyError("responses"), False),
}


@pytest.mark.parametrize("make, restarts", RESTARTS.values(), ids=RESTARTS.keys())
def test_only_a_process_that_died_restarts_the_run(make, restarts, tmp_path):
    budget = Restarts(recipe(tmp_path, allowed=3), first_plan=None)
    assert budget.take(make()) is restarts
    assert budget.done == (1 if restarts else 0)


@pytest.mark.parametrize("allowed", [0, 1, 2])
def test_restarts_stop_at_the_count(allowed, tmp_path):
    budget = Restarts(recipe(tmp_path, allowed), first_plan=None)
    granted = [budget.take(worker_error(died(), 0, "policy_update_actor")) for _ in range(4)]
    assert granted == [True] * allowed + [False] * (4 - allowed)


def test_a_dead_process_with_no_restart_left_is_one_line_naming_it(tmp_path):
    budget = Restarts(recipe(tmp_path, allowed=0), first_plan=None)
    with pytest.raises(WorkerProcessDied) as stopped:
        budget.after(worker_error(died(), 0, "policy_update_actor"))
    message = str(stopped.value)
    assert message.startswith(
        "worker rank 0 (HybridPolicyWorker, pid 4242) died during `policy_update_actor`: ActorDiedError: "
        "The actor died unexpectedly before finishing this task; the run stops: rerun the same command"
    )
    assert message.endswith("trainer.restart_on_failure=N restarts it by itself") and "\n" not in message


def test_an_exception_raised_in_a_worker_stops_the_run_unchanged(tmp_path):
    budget = Restarts(recipe(tmp_path, allowed=0), first_plan=None)
    err = in_the_worker(ValueError("bad"))
    with pytest.raises(type(err)) as stopped:
        budget.after(err)
    assert stopped.value is err


def test_a_save_a_dead_process_failed_names_the_process_then_the_save(tmp_path):
    """No restart left: the line leads with the death, as a dead process's call's does, then keeps
    the save's own words (its step, where a rerun resumes from)."""
    budget = Restarts(recipe(tmp_path, allowed=0), first_plan=None)
    with pytest.raises(WorkerProcessDied) as stopped:
        budget.after(RESTARTS["a checkpoint save a dead process failed"][0]())
    assert str(stopped.value) == (
        "worker rank 0 (HybridPolicyWorker, pid 4242) died during `policy_save`: step 3: saving failed; "
        "trainer.restart_on_failure=N restarts it by itself"
    )


def publish_checkpoint(cfg: RecipeConfig, step: int) -> Path:
    def write(directory: Path) -> None:
        save_trainer_state(directory / "trainer_state.pt", step, {"epoch": 0}, config=to_dict(cfg), extra={})

    return CheckpointManager(Path(cfg.trainer.output_dir) / "checkpoints").save(
        step, write, ["trainer_state.pt"]
    )


def test_a_restart_resumes_from_the_newest_checkpoint_else_from_the_start(tmp_path, capsys):
    cfg = recipe(tmp_path, allowed=2)
    budget = Restarts(cfg, first_plan=None)
    first_draws = [random.random() for _ in range(3)]
    assert budget.after(worker_error(died(), 0, "policy_generate_sequences")) is None
    assert [random.random() for _ in range(3)] == first_draws  # the driver draws as the run did
    assert capsys.readouterr().out == (
        "restart 1 of 2: worker rank 0 (HybridPolicyWorker, pid 4242) died during "
        "`policy_generate_sequences`; the workers were stopped, starting them again and resuming from the "
        "start (step 0): there is no checkpoint yet\n"
    )
    checkpoint = publish_checkpoint(cfg, 2)
    plan = budget.after(worker_error(died(), 0, "policy_update_actor"))
    assert (plan.point.step, plan.point.path) == (2, checkpoint)
    assert capsys.readouterr().out == (
        "restart 2 of 2: worker rank 0 (HybridPolicyWorker, pid 4242) died during `policy_update_actor`; "
        f"the workers were stopped, starting them again and resuming from {checkpoint} (step 2)\n"
    )


def test_a_checkpoint_of_an_earlier_run_is_not_restarted_from(tmp_path, capsys):
    """trainer.resume_mode=disable over an output directory with an earlier run's checkpoint: until
    this run publishes one, a restart starts over, as the run did."""
    cfg = recipe(tmp_path, allowed=2, resume_mode="disable")
    publish_checkpoint(cfg, 7)  # the earlier run's
    budget = Restarts(cfg, first_plan=None)
    assert budget.after(died()) is None
    assert "resuming from the start (step 0)" in capsys.readouterr().out
    checkpoint = publish_checkpoint(cfg, 1)  # this run's
    assert budget.after(died()).point.path == checkpoint


def test_restarts_without_checkpoints_are_warned_about(tmp_path, caplog):
    warn_if_restarts_start_over(recipe(tmp_path, allowed=2, save_freq=5))
    assert "restart_on_failure" not in caplog.text
    warn_if_restarts_start_over(recipe(tmp_path, allowed=2, save_freq=0))
    assert (
        "trainer.restart_on_failure=2 with trainer.save_freq=0: no checkpoint is written, so every restart "
        "trains from step 0 again; set trainer.save_freq" in caplog.text
    )


# ---------------------------------------------------------------- end to end

ONE_PROCESS = (
    "trainer.n_gpus_per_node=1", "actor.megatron.tensor_model_parallel_size=1",
    "trainer.save_freq=1", "trainer.export_hf=false",
)  # fmt: skip


@pytest.fixture(scope="module")
def local(tmp_path_factory) -> dict:
    return tiny_run_inputs(tmp_path_factory.mktemp("restart"))


def start(local: dict, output_dir: Path, marker: str, *overrides: str) -> tuple[subprocess.Popen, Path]:
    log = output_dir.parent / f"{output_dir.name}.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            command(local, output_dir, *ONE_PROCESS, *overrides), env=environment(local, marker),
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=as_from_a_terminal,
        )  # fmt: skip
    return proc, log


def kill_the_policy_worker_after(
    step: int, output_dir: Path, marker: str, proc: subprocess.Popen, log: Path
) -> int:
    """SIGKILL to the run's policy worker once the checkpoint of `step` is published; its pid."""
    checkpoints = CheckpointManager(output_dir / "checkpoints")
    wait_for(lambda: (checkpoints.latest_step() or 0) >= step or proc.poll() is not None, 900, f"step {step}")
    assert proc.poll() is None, log.read_text()[-3000:]
    (worker,) = actor_processes(marker, is_policy_worker)
    worker.kill()
    return worker.pid


def is_policy_worker(process: psutil.Process) -> bool:
    try:
        return " ".join(process.cmdline()).startswith("ray::HybridPolicyWorker")  # Ray's title: the class
    except psutil.Error:
        return False


@pytest.mark.slow
def test_a_killed_worker_restarts_the_run_from_its_checkpoint(local, tmp_path):
    marker, output_dir, steps = uuid.uuid4().hex, tmp_path / "run", 8  # steps take ~1 s: room to kill
    proc, log = start(
        local, output_dir, marker, f"trainer.total_training_steps={steps}", "trainer.restart_on_failure=1"
    )
    try:
        pid = kill_the_policy_worker_after(2, output_dir, marker, proc, log)
        assert proc.wait(timeout=900) == 0, log.read_text()[-3000:]
        output = log.read_text()
        restart = re.search(
            rf"restart 1 of 1: worker rank 0 \(HybridPolicyWorker, pid {pid}\) died during `\w+`; "
            r"the workers were stopped, starting them again and resuming from (\S+) \(step (\d+)\)",
            output,
        )
        assert restart, output[-3000:]
        resumed = int(restart[2])
        assert resumed >= 2 and f"resumed from {restart[1]} at step {resumed}" in output
        rows = read_metrics(output_dir / "metrics.jsonl")
        assert [row["step"] for row in rows] == list(range(1, steps + 1))
        assert [row["trainer/restarts"] for row in rows] == [0] * resumed + [1] * (steps - resumed)
        assert processes_with_env(f"HYBRIDFLOW_TEST_RUN={marker}") == []
    finally:
        cleanup(proc, marker)


@pytest.mark.slow
def test_without_restarts_a_killed_worker_ends_the_run_with_one_error_line(local, tmp_path):
    marker, output_dir = uuid.uuid4().hex, tmp_path / "run"
    proc, log = start(local, output_dir, marker, "trainer.total_training_steps=1000")
    try:
        pid = kill_the_policy_worker_after(1, output_dir, marker, proc, log)
        assert proc.wait(timeout=600) == 1, log.read_text()[-3000:]
        output = log.read_text()
        lines = output.rstrip().splitlines()
        assert "Traceback" not in output, output[-3000:]
        assert [line for line in lines if line.startswith("error:")] == lines[-1:]
        assert lines[-1].startswith(f"error: worker rank 0 (HybridPolicyWorker, pid {pid}) died during `")
        assert lines[-1].endswith("trainer.restart_on_failure=N restarts it by itself")
        assert "trainer/restarts" not in read_metrics(output_dir / "metrics.jsonl")[0]
        assert processes_with_env(f"HYBRIDFLOW_TEST_RUN={marker}") == []
    finally:
        cleanup(proc, marker)
