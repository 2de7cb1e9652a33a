"""Holds the rollout worker's generation calls, for tests/async_rl/test_engine_restarts.py (test
code only, never on a product run's path).

Python imports `sitecustomize` from the path as every process starts, so a run whose PYTHONPATH
names this directory loads it in each of its processes, Ray's workers included. With HOLD_ENV set
to a directory, `RolloutWorker.generate_sequences` is wrapped as its module is imported: once a
call has its tokens, the process writes <dir>/held.<pid>.<call> (the call's token count) and holds
the call until <dir>/release.<pid>.<call> or <dir>/release exists, so the test can kill the
process while the call is in flight.
"""

import functools
import importlib.abc
import importlib.machinery
import itertools
import os
import sys
import time
from pathlib import Path

HOLD_ENV = "HYBRIDFLOW_TEST_HOLD_GENERATION"
WORKER_MODULE = "hybridflow.workers.rollout_worker"
POLL_S = 0.05  # how often a held call looks for its release file


def hold(folder: Path, name: str, tokens: int) -> None:
    """Announce the held call, then wait until the test releases it (or kills the process)."""
    (folder / f"held.{name}").write_text(str(tokens))
    while not ((folder / f"release.{name}").exists() or (folder / "release").exists()):
        time.sleep(POLL_S)


def held(generate_sequences):
    """`generate_sequences`, each call held once it has its tokens (registration kept: wraps copies
    the function's attributes)."""
    calls = itertools.count(1)  # one rollout worker per process: its calls, numbered

    @functools.wraps(generate_sequences)
    def wrapper(self, prompts):
        output = generate_sequences(self, prompts)
        tokens = int(output.batch["response_mask"].sum())
        hold(Path(os.environ[HOLD_ENV]), f"{os.getpid()}.{next(calls)}", tokens)
        return output

    return wrapper


class HoldOnImport(importlib.abc.MetaPathFinder):
    """Finds the rollout worker's module as the path would, and wraps its generation once it ran."""

    def find_spec(self, name, path, target=None):
        if name != WORKER_MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        run_module = spec.loader.exec_module

        def exec_module(module) -> None:
            run_module(module)
            worker = module.RolloutWorker
            worker.generate_sequences = held(worker.generate_sequences)

        spec.loader.exec_module = exec_module
        return spec


if HOLD_ENV in os.environ:
    sys.meta_path.insert(0, HoldOnImport())
