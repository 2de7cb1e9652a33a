"""How a run ends, end to end through scripts/run_recipe.sh on the tiny quickstart setup:

- SIGINT: exit status 130 and one line, no traceback;
- SIGKILL of the driver: the script still removes everything the driver started;
- in both cases no process of the run is left the moment the script returns (each process of the
  run carries a marker in its environment, inherited from the script);
- the same holds for a process of the run in a process group of its own that ignores SIGTERM (as
  Ray's workers have their own groups), and a process the script cannot stop is named after a
  bounded wait instead of hanging it (scripts/lib/session.sh);
- SIGINT or SIGTERM sent to scripts/quickstart.sh alone (as a job scheduler or `timeout` sends it)
  reaches the stage it is running, and the script returns after that stage's teardown, with the
  shell's status for the signal (130, 143) and one line (no native stack dump from Ray);
- a NaN reward stops the run at step 1 with an error naming the step, the reward function and the
  data_source, and nothing is published (no checkpoint, no `latest`, no HF export);
- a rollout pool process killed mid-run ends the run with one `error:` line naming it (status 1);
- with trainer.nonfinite_policy=skip the same run completes, counts the skipped steps, and
  exports the untouched initial weights.

The last two are about the run, not its process: they run in process, on this pytest worker's Ray
cluster (tests/recipe_runs.py).
"""

import contextlib
import os
import shutil
import signal
import subprocess
import uuid
from pathlib import Path

import psutil
import pytest
import torch
from hf_weights import load_hf_tensors
from multinode_helpers import processes_with_env
from process_group import run_in_own_session
from recipe_runs import run_recipe_in_process
from run_processes import actor_processes, as_from_a_terminal, cleanup, marker_in, wait_for
from tiny_run import RECIPE, ROOT, command, environment, overrides, tiny_run_inputs

from hybridflow.utils.tracking import read_metrics, records_up_to

pytestmark = pytest.mark.slow

NAN_REWARD = """
def always_nan(data_source, solution_str, ground_truth, extra_info):
    return float("nan")
"""


@pytest.fixture(scope="module")
def local(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("lifecycle")
    (root / "nan_reward.py").write_text(NAN_REWARD)
    return tiny_run_inputs(root)


def start_and_wait_for_step_1(
    local: dict, output_dir: Path, marker: str, *overrides: str
) -> tuple[subprocess.Popen, Path]:
    log = output_dir.parent / f"{output_dir.name}.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            command(local, output_dir, "trainer.total_training_steps=1000", *overrides),
            env=environment(local, marker),
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=as_from_a_terminal,
        )  # fmt: skip
    wait_for(lambda: step_1_logged(output_dir) or proc.poll() is not None, 900, "step 1")
    assert proc.poll() is None, log.read_text()[-3000:]
    return proc, log


def step_1_logged(output_dir: Path) -> bool:
    """metrics.jsonl holds step 1's whole line (the trainer may be writing it right now)."""
    return bool(records_up_to(output_dir / "metrics.jsonl", 1)[0])


def test_sigint_exits_130_with_one_line_and_leaves_nothing(local, tmp_path):
    marker = uuid.uuid4().hex
    proc, log = start_and_wait_for_step_1(local, tmp_path / "run", marker)
    try:
        proc.send_signal(signal.SIGINT)  # to the script, as Ctrl-C in a terminal would
        assert proc.wait(timeout=600) == 130, log.read_text()[-3000:]
        output = log.read_text()
        assert "Traceback" not in output, output[-3000:]
        assert output.rstrip().splitlines()[-1] == (
            "interrupted (SIGINT): rerun the same command to resume from the last checkpoint"
        )
        assert processes_with_env(f"HYBRIDFLOW_TEST_RUN={marker}") == []
    finally:
        cleanup(proc, marker)


def test_sigkill_of_the_driver_leaves_nothing(local, tmp_path):
    marker = uuid.uuid4().hex
    proc, log = start_and_wait_for_step_1(local, tmp_path / "run", marker)
    try:
        (driver,) = psutil.Process(proc.pid).children()
        assert "hybridflow.trainer.main" in " ".join(driver.cmdline())
        assert len(psutil.Process(driver.pid).children(recursive=True)) > 1  # Ray and workers
        driver.kill()
        assert proc.wait(timeout=600) == 128 + signal.SIGKILL, log.read_text()[-3000:]
        assert processes_with_env(f"HYBRIDFLOW_TEST_RUN={marker}") == []
    finally:
        cleanup(proc, marker)


DISAGGREGATED = (
    "trainer.placement=disaggregated", "trainer.n_gpus_per_node=1",
    "actor.megatron.tensor_model_parallel_size=1", "trainer.rollout_pool.n_gpus_per_node=1",
)  # fmt: skip


def test_a_killed_rollout_process_ends_the_run_with_one_named_error(local, tmp_path):
    """The rollout pool's process killed between steps, with no restart allowed
    (rollout.max_engine_restarts=0; restarts: tests/async_rl/test_engine_restarts.py): whichever
    call meets the dead process first (the next weight transfer or generation), the run ends with
    status 1 and one `error:` line naming the rollout process, no traceback, nothing left running."""
    marker = uuid.uuid4().hex
    no_restart = "rollout.max_engine_restarts=0"
    proc, log = start_and_wait_for_step_1(local, tmp_path / "run", marker, *DISAGGREGATED, no_restart)
    try:
        (rollout,) = actor_processes(marker, is_rollout_worker)
        rollout.kill()
        assert proc.wait(timeout=600) == 1, log.read_text()[-3000:]
        output = log.read_text()
        assert "Traceback" not in output, output[-3000:]
        last = output.rstrip().splitlines()[-1]
        assert last.startswith("error: rollout pool process 0 died during `"), output[-3000:]
        assert processes_with_env(f"HYBRIDFLOW_TEST_RUN={marker}") == []
    finally:
        cleanup(proc, marker)


def is_rollout_worker(process: psutil.Process) -> bool:
    try:
        return "RolloutWorker" in " ".join(process.cmdline())  # Ray titles an actor's process by class
    except psutil.Error:
        return False


def run(local: dict, output_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    settings = overrides(
        local, output_dir, "trainer.total_training_steps=2", "trainer.save_freq=1",
        "reward.custom_fn=nan_reward.always_nan", *extra,
    )  # fmt: skip
    return run_recipe_in_process(RECIPE, settings, pythonpath=local["root"])


@pytest.mark.usefixtures("ray_cluster")
def test_nan_reward_stops_the_run_and_publishes_nothing(local, tmp_path):
    result = run(local, tmp_path / "run")
    assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert (
        "error: step 1: reward function nan_reward.always_nan on response 0 (data_source 'arith') "
        "returned nan"
    ) in result.stderr
    assert not (tmp_path / "run" / "checkpoints" / "latest").exists()
    assert not list((tmp_path / "run" / "checkpoints").glob("global_step_*"))
    assert not (tmp_path / "run" / "hf").exists()


@pytest.mark.usefixtures("ray_cluster")
def test_skip_policy_counts_skipped_steps_and_keeps_the_weights(local, tmp_path):
    result = run(local, tmp_path / "run", "trainer.nonfinite_policy=skip")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "step 1 skipped: reward function nan_reward.always_nan" in result.stdout
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [(r["step"], r["nonfinite/skipped_steps"]) for r in rows] == [(1, 1), (2, 2)]
    exported, initial = load_hf_tensors(tmp_path / "run" / "hf"), load_hf_tensors(Path(local["model"]))
    assert exported.keys() == initial.keys() and exported
    assert all(torch.equal(exported[k], initial[k]) for k in initial)  # no update was applied


def quickstart_checkout(tmp_path: Path) -> Path:
    """A checkout of this repository whose outputs/ lie in `tmp_path`: code, scripts, recipes and
    the virtual environment (when there is one) are links to this one."""
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    for name in ("hybridflow", "scripts", "recipes", ".venv"):
        if (ROOT / name).exists():
            (checkout / name).symlink_to(ROOT / name)
    return checkout


def training_started(marker: str) -> bool:
    """A worker of the run is up (the driver is past connecting to Ray: its signal handlers are
    the run's own)."""
    for process in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            title = " ".join(process.cmdline())  # Ray titles an actor's process by its class
            if marker_in(process, marker) and title.startswith("ray::HybridPolicyWorker"):
                return True
    return False


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["sigint", "sigterm"])
def test_a_signal_to_the_quickstart_script_stops_its_running_stage(tmp_path, sig):
    marker = uuid.uuid4().hex
    checkout = quickstart_checkout(tmp_path)
    log = tmp_path / "quickstart.log"
    env = {**os.environ, "HYBRIDFLOW_TEST_RUN": marker}
    with open(log, "w") as out:
        proc = subprocess.Popen(
            ["bash", checkout / "scripts/quickstart.sh"], cwd=checkout, env=env,
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=as_from_a_terminal,
        )  # fmt: skip
    try:
        wait_for(lambda: training_started(marker) or proc.poll() is not None, 900, "SFT stage's workers")
        assert proc.poll() is None, log.read_text()[-3000:]
        proc.send_signal(sig)  # to the script alone, not its process group
        status = proc.wait(timeout=600)
        assert processes_with_env(f"HYBRIDFLOW_TEST_RUN={marker}") == []
        output = log.read_text()
        assert status == 128 + sig, output[-3000:]
        assert "Traceback" not in output and "SIGTERM received" not in output, output[
            -3000:
        ]  # no native dump
        assert output.rstrip().splitlines()[-1] == (
            f"interrupted ({sig.name}): rerun the same command to resume from the last checkpoint"
        )
        assert not (checkout / "outputs/quickstart/sft/hf").exists()
    finally:
        cleanup(proc, marker)


# A stand-in driver for scripts/run_recipe.sh: starts a "worker" in a process group of its own
# (as Ray's raylet starts each worker) that ignores SIGTERM, writes its PID, and exits with 3.
FAKE_DRIVER = """
import signal, subprocess, sys
worker = subprocess.Popen(
    [sys.executable, "-c", "import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
     "print('ready', flush=True); time.sleep(3600)"],
    process_group=0, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
)
worker.stdout.readline()
open(sys.argv[1], "w").write(str(worker.pid))
sys.exit(3)
"""


def fake_checkout(tmp_path: Path) -> Path:
    """A checkout whose `python -m hybridflow.trainer.main` is FAKE_DRIVER; scripts are this one's."""
    checkout = tmp_path / "checkout"
    (checkout / "hybridflow" / "trainer").mkdir(parents=True)
    for package in ("hybridflow", "hybridflow/trainer"):
        (checkout / package / "__init__.py").write_text("")
    (checkout / "hybridflow" / "trainer" / "main.py").write_text(FAKE_DRIVER)
    (checkout / "scripts").symlink_to(ROOT / "scripts")
    if (ROOT / ".venv").exists():
        (checkout / ".venv").symlink_to(ROOT / ".venv")
    return checkout


def test_the_script_returns_only_after_a_worker_in_its_own_group_is_gone(tmp_path):
    pid_file, checkout = tmp_path / "worker.pid", fake_checkout(tmp_path)
    done = run_in_own_session(  # cwd: `python -m` imports from the working directory first
        ["bash", checkout / "scripts/run_recipe.sh", pid_file], cwd=checkout,
        env={**os.environ, "HYBRIDFLOW_STOP_GRACE_S": "1"}, timeout=300,
    )  # fmt: skip
    worker = int(pid_file.read_text())
    try:
        assert done.returncode == 3, done.stderr
        assert not running(worker)
        assert "still running" not in done.stderr
    finally:
        if running(worker):
            os.kill(worker, signal.SIGKILL)


def running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"), reason="needs root and setpriv")
def test_a_process_that_outlives_sigkill_is_named_after_a_bounded_wait(tmp_path):
    """A process the stopping shell may not signal (root's, stopped by user nobody) stands in for
    one in uninterruptible sleep: stop_session gives up after its bound and names it."""
    sleeper = subprocess.Popen(["setsid", "sleep", "3600"])  # setsid execs: the PID is the session
    try:
        stop = (
            f"source {ROOT / 'scripts/lib/session.sh'}; stop_session {sleeper.pid} 1 run_recipe.sh; "
            "echo returned $?"
        )
        done = subprocess.run(
            ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "bash", "-c", stop],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert done.stdout.strip() == "returned 1", done.stderr
        assert "run_recipe.sh: these processes of the run are still running 1s after SIGKILL" in done.stderr
        assert f"{sleeper.pid}" in done.stderr and "sleep 3600" in done.stderr
    finally:
        sleeper.kill()
        sleeper.wait()
