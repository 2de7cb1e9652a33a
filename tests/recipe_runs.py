"""A recipe run in the test's own process, on this pytest worker's Ray cluster.

`run_recipe_in_process(recipe, overrides, pythonpath=...)` is what `scripts/run_recipe.sh` does
(hybridflow.trainer.main.main) without what each run would pay again: a Python start, the driver's
imports and a local Ray cluster of its own with its daemons. It returns a
`subprocess.CompletedProcess` like tests/process_group.py's `run_recipe_script`, with the run's
stdout and stderr and main's exit status, so a test can move between the two by its subject:
a test of the run's outcome (metrics, checkpoints, exports, the `error:` line of a refused recipe)
runs here; a test of the process (signals, SIGKILL, disk full, Slurm, the shell's exit code)
starts one with `run_recipe_script`.

The cluster is tests/conftest.py's session-scoped `ray_cluster`: a test requests it, itself or
through a fixture of its own. `main` leaves a connection its caller made to the caller. What a
run changes in this process is put back after it: the signal handlers main installs, the working
directory, `sys.path` and the modules imported from `pythonpath` (two test files may each write a
reward module of the same name). `pythonpath` reaches the driver only: worker processes see none of
this process's changes, so a run that needs an environment variable in its workers runs as a
process. The one exception is fixed at the cluster's start: its workers import the modules of
WORKER_TEST_DIRS (tests/agents: agents the workers' rollout imports by `module:function`) and of
conftest's session directory `worker_modules` (a user's module a test writes, e.g. a policy loss
the actor imports), as a run's process had them on its PYTHONPATH.
"""

import contextlib
import io
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Directories of test modules the session cluster's worker processes import (on their PYTHONPATH).
WORKER_TEST_DIRS = (ROOT / "tests" / "agents",)


def run_recipe_in_process(
    recipe: str, overrides: list[str], *, pythonpath: Path | list[Path] | None = None
) -> subprocess.CompletedProcess:
    """main([recipe, *overrides]) from the repository root (recipe relative to it), with
    `pythonpath` (a directory or several: custom reward modules) importable for the run's length."""
    from hybridflow.trainer.main import main

    argv = [str(ROOT / recipe), *map(str, overrides)]
    stdout, stderr = io.StringIO(), io.StringIO()
    with (
        process_state_kept(pythonpath),
        contextlib.chdir(ROOT),
        contextlib.redirect_stdout(stdout),
        contextlib.redirect_stderr(stderr),
    ):
        returncode = main(argv)
    return subprocess.CompletedProcess(argv, returncode, stdout.getvalue(), stderr.getvalue())


@contextlib.contextmanager
def process_state_kept(pythonpath: Path | list[Path] | None) -> Iterator[None]:
    """Signal handlers, sys.path and the modules under `pythonpath` as they were, after the block."""
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    path = list(sys.path)
    directories = [pythonpath] if isinstance(pythonpath, str | Path) else list(pythonpath or [])
    sys.path[:0] = map(str, directories)
    try:
        yield
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        sys.path[:] = path
        for directory in directories:
            forget_modules_under(Path(directory))


def forget_modules_under(directory: Path) -> None:
    """Drops from sys.modules every module whose file lies under `directory`."""
    for name, module in list(sys.modules.items()):
        file = getattr(module, "__file__", None)
        if file and Path(file).resolve().is_relative_to(directory.resolve()):
            del sys.modules[name]


@contextlib.contextmanager
def workers_import_from(worker_modules: Path) -> Iterator[None]:
    """A Ray node started inside the block gives its worker processes WORKER_TEST_DIRS and
    `worker_modules` on their PYTHONPATH: the raylet, which starts them, inherits this process's
    environment at its start. The environment is put back after the block, so that no other
    process started later (a test's own run, with its own PYTHONPATH) gets it."""
    before = os.environ.get("PYTHONPATH")
    directories = [*WORKER_TEST_DIRS, worker_modules]
    os.environ["PYTHONPATH"] = os.pathsep.join([*map(str, directories), *filter(None, [before])])
    try:
        yield
    finally:
        if before is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = before
