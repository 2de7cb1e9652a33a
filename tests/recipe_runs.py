"""A recipe run in the test's own process, on this pytest worker's Ray cluster.

`run_recipe_in_process(recipe, overrides, pythonpath=...)` is what `scripts/run_recipe.sh` does
(hybridflow.trainer.main.main) without what each run would pay again: a Python start, the driver's
imports and a local Ray cluster of its own with its daemons. It returns a
`subprocess.CompletedProcess` like tests/process_group.py's `run_recipe_script`, with the run's
stdout and stderr and main's exit status, so a test can move between the two by its subject:
a test of the run's outcome (metrics, checkpoints, exports, the `error:` line of a refused recipe)
runs here; a test of the process (signals, SIGKILL, disk full, Slurm, the shell's exit code)
starts one with `run_recipe_script`.

The cluster is tests/conftest.py's session-scoped `ray_cluster` (request it through the
`recipe_in_process` fixture). `main` leaves a connection its caller made to the caller. What a
run changes in this process is put back after it: the signal handlers main installs, the working
directory, `sys.path` and the modules imported from `pythonpath` (two test files may each write a
reward module of the same name). Worker processes see none of this process's environment
changes, so a run that needs an environment variable in its workers runs as a process.
"""

import contextlib
import io
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_recipe_in_process(
    recipe: str, overrides: list[str], *, pythonpath: Path | None = None
) -> subprocess.CompletedProcess:
    """main([recipe, *overrides]) from the repository root (recipe relative to it), with
    `pythonpath` (custom reward modules) importable for the run's length."""
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
def process_state_kept(pythonpath: Path | None) -> Iterator[None]:
    """Signal handlers, sys.path and the modules under `pythonpath` as they were, after the block."""
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    path = list(sys.path)
    if pythonpath is not None:
        sys.path.insert(0, str(pythonpath))
    try:
        yield
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        sys.path[:] = path
        if pythonpath is not None:
            forget_modules_under(Path(pythonpath))


def forget_modules_under(directory: Path) -> None:
    """Drops from sys.modules every module whose file lies under `directory`."""
    for name, module in list(sys.modules.items()):
        file = getattr(module, "__file__", None)
        if file and Path(file).resolve().is_relative_to(directory.resolve()):
            del sys.modules[name]
