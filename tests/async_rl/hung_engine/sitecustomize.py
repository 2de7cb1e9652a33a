"""Hangs one rollout engine mid-generation, for tests/async_rl/test_hung_engine_run.py (test code
only, never on a product run's path).

Python imports `sitecustomize` from the path as every process starts, so a run whose PYTHONPATH
names this directory loads it in each of its processes, Ray's workers included. With HANG_ENV set
to a directory, `VLLMRequestEngine._absorb` (a decoding step's output, on the engine's event loop)
is wrapped as its module is imported: the process whose engine absorbs its HANG_AT_ENV-th output
first claims the hang (<dir>/hung.<pid>, created once in the run) and blocks that step forever,
with the event loop's thread, as a step stuck in a kernel or a collective would. Its process stays
alive and answers Ray; its engine answers nothing more. Every other process, a restarted one
included, generates as usual.
"""

import functools
import importlib.abc
import importlib.machinery
import itertools
import os
import sys
import threading
from pathlib import Path

HANG_ENV = "HYBRIDFLOW_TEST_HANG_ENGINE"
HANG_AT_ENV = "HYBRIDFLOW_TEST_HANG_AT"  # the decoding-step output, counted per process, that hangs
ENGINE_MODULE = "engines.rollout.requests"


def claim_hang(folder: Path) -> bool:
    """Whether this process is the run's one to hang: the first to create the claim file."""
    try:
        fd = os.open(folder / "claimed", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    os.close(fd)
    (folder / f"hung.{os.getpid()}").touch()
    return True


def hanging(absorb):
    """`absorb`, whose HANG_AT_ENV-th call in the claiming process never returns."""
    outputs = itertools.count(1)
    at = int(os.environ[HANG_AT_ENV])

    @functools.wraps(absorb)
    def wrapper(self, output):
        if next(outputs) == at and claim_hang(Path(os.environ[HANG_ENV])):
            threading.Event().wait()  # never set: the step, and the loop, stop here
        return absorb(self, output)

    return wrapper


class HangOnImport(importlib.abc.MetaPathFinder):
    """Finds the request engine's module as the path would, and wraps its step once it ran."""

    def find_spec(self, name, path, target=None):
        if name != ENGINE_MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        run_module = spec.loader.exec_module

        def exec_module(module) -> None:
            run_module(module)
            engine = module.VLLMRequestEngine
            engine._absorb = hanging(engine._absorb)

        spec.loader.exec_module = exec_module
        return spec


if HANG_ENV in os.environ:
    sys.meta_path.insert(0, HangOnImport())
