"""What a pytest run makes once for all its pytest-xdist workers (fitted models, warm starts, data):
`made_once(root, make)` under `run_shared_dir(tmp_path_factory, worker_id)`."""

import shutil
from collections.abc import Callable
from pathlib import Path

from filelock import FileLock


def run_shared_dir(tmp_path_factory, worker_id: str) -> Path:
    """A directory shared by this run's pytest-xdist workers (their base temporary directories'
    parent is the run's own), or this process's base directory when xdist is off: never one an
    earlier run left."""
    base = tmp_path_factory.getbasetemp()
    return base if worker_id == "master" else base.parent


def made_once(root: Path, make: Callable[[Path], None]) -> None:
    """`make(root)` once for the whole run, whichever pytest-xdist worker asks first: the others
    wait on a file lock and find it done; a worker's failed attempt is removed and made again."""
    with FileLock(f"{root}.lock"):
        if not (root / "done").exists():
            shutil.rmtree(root, ignore_errors=True)
            make(root)
            (root / "done").touch()
