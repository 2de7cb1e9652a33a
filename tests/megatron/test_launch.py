"""`run_distributed` leaves no process behind when torchrun is stopped early: on its timeout and on
Ctrl-C (KeyboardInterrupt), torchrun and each worker it started (in sessions of their own) are gone.

The workers record their PIDs and torchrun's, then wait for a file that is never created, so only
the teardown can end them. With a plain `subprocess.run(timeout=...)` torchrun is SIGKILLed and its
workers live on."""

import signal
import threading
import time
from pathlib import Path

import psutil
import pytest
from launch import run_distributed

NPROC = 2
WORKER = """
import os
import sys
import time
from pathlib import Path

pid_dir, release = Path(sys.argv[1]), Path(sys.argv[2])
(pid_dir / f"{os.environ['RANK']}.tmp").write_text(f"{os.getpid()} {os.getppid()}")
(pid_dir / f"{os.environ['RANK']}.tmp").rename(pid_dir / f"{os.environ['RANK']}.pids")
while not release.exists():  # never created: only a signal ends this worker
    time.sleep(0.2)
"""


def write_worker(tmp_path: Path) -> tuple[Path, Path]:
    script = tmp_path / "_blocked_worker.py"
    script.write_text(WORKER)
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    return script, pid_dir


def recorded_pids(pid_dir: Path) -> set[int]:
    return {int(pid) for f in pid_dir.glob("*.pids") for pid in f.read_text().split()}


def wait_until(condition, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return condition()


def running(pids: set[int]) -> set[int]:
    alive = set()
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.add(pid)
        except psutil.NoSuchProcess:
            pass
    return alive


def assert_all_gone(pid_dir: Path) -> None:
    pids = recorded_pids(pid_dir)
    assert wait_until(lambda: not running(pids), timeout_s=60), f"still running: {sorted(running(pids))}"


@pytest.mark.slow
def test_timeout_stops_torchrun_and_its_workers(tmp_path):
    script, pid_dir = write_worker(tmp_path)
    # The timeout must fire after every worker started; doubled until it does (torchrun's start
    # takes seconds, more on a loaded machine). Each try checks that nothing outlives it.
    for timeout_s in (5, 10, 20, 40, 80, 160):
        for stale in pid_dir.iterdir():
            stale.unlink()
        with pytest.raises(RuntimeError, match=rf"_blocked_worker.py x{NPROC} timed out after {timeout_s}s"):
            run_distributed(script, NPROC, pid_dir, tmp_path / "never", timeout=timeout_s)
        assert_all_gone(pid_dir)
        if len(list(pid_dir.glob("*.pids"))) == NPROC:
            break
    assert len(recorded_pids(pid_dir)) == NPROC + 1  # the workers and torchrun, all seen and gone


@pytest.mark.slow
def test_ctrl_c_stops_torchrun_and_its_workers(tmp_path):
    script, pid_dir = write_worker(tmp_path)
    main_thread = threading.main_thread().ident

    def interrupt_once_all_started():
        if wait_until(lambda: len(list(pid_dir.glob("*.pids"))) == NPROC, timeout_s=300):
            signal.pthread_kill(main_thread, signal.SIGINT)  # what Ctrl-C delivers to pytest

    # Python's own Ctrl-C handler, whatever pytest inherited: started as a background job of a
    # shell without job control, it begins with SIGINT ignored and would never see the signal.
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        watcher = threading.Thread(target=interrupt_once_all_started, daemon=True)
        watcher.start()
        with pytest.raises(KeyboardInterrupt):
            run_distributed(script, NPROC, pid_dir, tmp_path / "never", timeout=600)
        watcher.join()
    finally:
        signal.signal(signal.SIGINT, inherited)
    assert len(recorded_pids(pid_dir)) == NPROC + 1
    assert_all_gone(pid_dir)
