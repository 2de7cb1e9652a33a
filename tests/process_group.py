"""Run a command that starts processes of its own, and leave none of them behind.

`run_in_own_session(cmd, timeout=..., **popen_kwargs)` is `subprocess.run(cmd, capture_output=True,
text=True, timeout=...)` for launchers such as torchrun or scripts/run_recipe.sh. subprocess.run
SIGKILLs only the command's own process on a timeout or Ctrl-C; its children live on, and
torchrun's workers run in sessions of their own, out of reach of the launcher's process group.
Here the command starts in its own session, and on a timeout or any exception (KeyboardInterrupt
included) `stop_process_tree` ends it and everything it started, by process group and by PID:

- SIGTERM to the command's process group, so the launcher stops its workers in order (torchrun
  terminates their groups; run_recipe.sh tears down the driver's group);
- up to `grace_s` (default HYBRIDFLOW_STOP_GRACE_S + 50 s) for the group and every descendant
  seen to exit;
- SIGKILL to the group and to each descendant still running, then wait until they are gone.

Descendants are tracked as psutil processes, which refuse to signal a PID the kernel reused.

`run_recipe_script(recipe, overrides, timeout=...)` runs scripts/run_recipe.sh that way;
`run_and_kill_at_step` SIGKILLs a run (all of it) once its metrics record a step.
"""

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

import psutil

REPO_ROOT = Path(__file__).resolve().parents[1]


def default_grace_s() -> float:
    """Longer than run_recipe.sh's own teardown (HYBRIDFLOW_STOP_GRACE_S, default 10 s) and the
    launcher's shutdown, so the SIGKILL is a last resort."""
    return float(os.environ.get("HYBRIDFLOW_STOP_GRACE_S", "10")) + 50


def run_in_own_session(
    cmd, *, timeout: float, grace_s: float | None = None, **popen_kwargs
) -> subprocess.CompletedProcess:
    """Run `cmd` with stdout and stderr captured as text. On a timeout: every process stopped,
    then `subprocess.TimeoutExpired` with the output so far; any other exception is re-raised
    after the same teardown."""
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True, **popen_kwargs
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except BaseException as err:
        stop_process_tree(proc, default_grace_s() if grace_s is None else grace_s)
        stdout, stderr = read_rest(proc)
        if isinstance(err, subprocess.TimeoutExpired):
            raise subprocess.TimeoutExpired(cmd, timeout, output=stdout, stderr=stderr) from None
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def run_recipe_script(
    recipe: str, overrides: list[str], *, timeout: float, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """`bash scripts/run_recipe.sh <recipe> <overrides...>` (recipe relative to the repository
    root) in a fresh local Ray cluster (RAY_ADDRESS=local: never a cluster another test or job
    runs), Python warnings off; `env` adds to or replaces variables of this process's environment."""
    return run_in_own_session(recipe_command(recipe, overrides), env=recipe_environment(env), timeout=timeout)


def recipe_command(recipe: str, overrides: list[str]) -> list:
    return ["bash", REPO_ROOT / "scripts/run_recipe.sh", REPO_ROOT / recipe, *overrides]


def recipe_environment(env: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment for a run in a fresh local Ray cluster, warnings off, with `env`."""
    return {**os.environ, "RAY_ADDRESS": "local", "PYTHONWARNINGS": "ignore", **(env or {})}


def stop_process_tree(proc: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM to `proc`'s process group, SIGKILL to the group and every descendant left after
    `grace_s`; returns once `proc` is reaped and no descendant is running. `proc` is reaped last:
    until then its PID, the group's ID, cannot be given to another process."""
    tree = descendants(proc.pid)
    signal_group(proc, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and (leader_running(proc) or running(tree)):
        tree |= descendants(proc.pid)
        time.sleep(0.1)
    tree |= descendants(proc.pid)
    signal_group(proc, signal.SIGKILL)
    for child in running(tree):
        with contextlib.suppress(psutil.Error):  # gone, or its PID reused: nothing of ours to kill
            child.send_signal(signal.SIGKILL)
    proc.wait()
    while running(tree):
        time.sleep(0.1)


def leader_running(proc: subprocess.Popen) -> bool:
    """Whether `proc` has yet to exit, checked without reaping it."""
    if proc.returncode is not None:
        return False
    return os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None


def descendants(pid: int) -> set[psutil.Process]:
    try:
        return set(psutil.Process(pid).children(recursive=True))
    except psutil.NoSuchProcess:
        return set()


def running(processes: set[psutil.Process]) -> list[psutil.Process]:
    """The processes still running (a zombie has exited; its parent has yet to reap it)."""
    alive = []
    for process in processes:
        try:
            if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                alive.append(process)
        except psutil.NoSuchProcess:
            pass
    return alive


def signal_group(proc: subprocess.Popen, sig: signal.Signals) -> None:
    """Signal `proc`'s process group while `proc` is unreaped (after that its members are
    reached by PID only)."""
    if proc.returncode is not None:
        return
    with contextlib.suppress(ProcessLookupError):  # the group is empty
        os.killpg(proc.pid, sig)


def read_rest(proc: subprocess.Popen, timeout_s: float = 10) -> tuple[str, str]:
    """The output not read yet. A process outside the tree (one that left it before it was seen)
    may still hold the pipes open; then what was read so far is lost rather than waited for."""
    try:
        return proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        for pipe in (proc.stdout, proc.stderr):
            pipe.close()
        return "", ""


def run_and_kill_at_step(cmd, env: dict, metrics: Path, step: int, log: Path) -> None:
    """Starts `cmd` (a run writing `metrics`, metrics.jsonl) in its own process group, output into
    `log`, and SIGKILLs the group (driver, Ray, workers) and every descendant as soon as the
    metrics record `step`."""
    from hybridflow.utils.tracking import read_metrics

    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 1200  # generous: a loaded 2-core machine
        try:
            while not any(r["step"] >= step for r in read_metrics(metrics)):
                assert proc.poll() is None, f"run ended before step {step}: {log}"
                assert time.monotonic() < deadline, f"no step {step} within 1200 s: {log}"
                time.sleep(0.2)
        finally:
            family = psutil.Process(proc.pid).children(recursive=True) if proc.poll() is None else []
            os.killpg(proc.pid, signal.SIGKILL)
            for child in family:  # Ray processes that left the group
                if child.is_running():
                    child.kill()
            proc.wait()
