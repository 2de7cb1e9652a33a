"""The processes of a run started as a process of its own, for the tests whose subject is how they
end (tests/test_run_lifecycle.py, tests/test_restart_on_failure.py, tests/async_rl/*): waiting for
a condition, the run's Ray actors found by the marker in their environment (tests/tiny_run.py's
`environment`), and what a failed test leaves removed."""

import os
import signal
import subprocess
import time
from collections.abc import Callable

import psutil


def wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"no {what} within {timeout} s"
        time.sleep(0.2)


def as_from_a_terminal() -> None:
    """In the child before exec: SIGINT at its default, as a shell leaves it for a command it runs
    in the foreground. Tests started in the background (`pytest ... &` in a script) inherit SIGINT
    ignored, and a shell script cannot trap a signal that was ignored when it started."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def cleanup(proc: subprocess.Popen, marker: str) -> None:
    """After a failed assertion: remove whatever the run left (by PID)."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    for pid in [int(p.pid) for p in psutil.process_iter() if marker_in(p, marker)]:
        psutil.Process(pid).kill()


def marker_in(process: psutil.Process, marker: str) -> bool:
    try:
        return process.environ().get("HYBRIDFLOW_TEST_RUN") == marker
    except psutil.Error:
        return False


def actor_processes(marker: str, is_actor: Callable[[psutil.Process], bool]) -> list[psutil.Process]:
    """The run's processes that `is_actor` picks, less their forked children, which keep the title
    Ray gave their parent (Megatron's checkpoint writers fork from the policy worker during a save)."""
    picked = [p for p in psutil.process_iter(["ppid"]) if marker_in(p, marker) and is_actor(p)]
    pids = {p.pid for p in picked}
    return [p for p in picked if p.info["ppid"] not in pids]  # info: None for one gone meanwhile
