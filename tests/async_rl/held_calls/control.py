"""The test's side of sitecustomize.py (beside it): the environment of a run whose rollout processes
hold chosen calls, and waiting for, reading, releasing and killing the processes that hold them.
Imported by the tests only, never by a run."""

import json
import os
import signal
import subprocess
from pathlib import Path

import psutil
from held_calls.sitecustomize import HOLD_CALLS_ENV, HOLD_DIR_ENV
from run_processes import wait_for

HELD_CALLS = Path(__file__).parent  # on a run's PYTHONPATH: its sitecustomize is this folder's


def held_environment(hold: Path, calls: str, path: Path) -> dict:
    """A run's variables for holding `calls` (sitecustomize's spec, e.g. "save_rng_state:1") in
    `hold`, with `path` on its PYTHONPATH too (the run's reward modules)."""
    return {HOLD_DIR_ENV: str(hold), HOLD_CALLS_ENV: calls, "PYTHONPATH": f"{HELD_CALLS}{os.pathsep}{path}"}


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


def held_generation(hold: Path, proc: subprocess.Popen, number: str, not_pids=()) -> tuple[int, dict]:
    """A process holding its generation call `number` ("1", "armed", ...) and the call's note
    ({"tokens", "prompts"}): its tokens generated, its answer not returned."""
    pid = holders(hold, proc, f"generate_sequences.{number}", not_pids=not_pids)[0]
    note = json.loads((hold / f"held-generate_sequences.{pid}.{number}").read_text())
    assert note["tokens"] > 0 and note["prompts"], note
    return pid, note


def release(hold: Path, call: str, pid: int) -> None:
    """Let `pid`'s held `call` ("method.n") go on."""
    method, number = call.split(".")
    (hold / f"release-{method}.{pid}.{number}").touch()


def kill(pid: int) -> None:
    psutil.Process(pid).send_signal(signal.SIGKILL)
