"""Holds chosen calls of a run's rollout processes, for the engine-restart tests of tests/async_rl
(test code only, never on a product run's path): a process can then be killed while it is inside a
generation, a checkpoint save or a weight transfer, as a condition, not a timing.

Python imports `sitecustomize` from the path as every process starts, so a run whose PYTHONPATH
names this directory loads it in each of its processes, Ray's workers included. HOLD_DIR_ENV names
a directory; HOLD_CALLS_ENV lists `method:n` pairs (comma-separated) of HELD_METHODS. As a method's
module is imported, the method is wrapped: its n-th call in a process (counted per process, from 1)
writes <dir>/held-<method>.<pid>.<n> and waits until <dir>/release-<method>.<pid>.<n> or
<dir>/release-<method> (every call of the method) or <dir>/release (every call) exists; with
`method:every`, every call is held so. With `method:armed`, the first call of the method in any
process after the test wrote <dir>/arm-<method> is held instead, once (that process takes the file
away), as <dir>/held-<method>.<pid>.armed: counts per process shift as processes are restarted, a
call the test arms when it gets there does not.

A call is held before it runs, but a generation once it has run: its held file then holds the
number of tokens it generated and its rows' prompts (`{"tokens": 12, "prompts": [[ids], ...]}`), and
its answer is not returned until the release.
"""

import functools
import importlib.abc
import importlib.machinery
import itertools
import json
import os
import sys
import time
from pathlib import Path

HOLD_DIR_ENV = "HYBRIDFLOW_TEST_HOLD_DIR"
HOLD_CALLS_ENV = "HYBRIDFLOW_TEST_HOLD_CALLS"
POLL_S = 0.05  # how often a held call looks for its release file
# method -> (module, class): a rollout process's generation, one request (an agent's turn a router
# sent), its checkpoint save, and its receive of a transfer (in the worker's background thread,
# while the actor's sender streams the buckets)
HELD_METHODS = {
    "generate_sequences": ("hybridflow.workers.rollout_worker", "RolloutWorker"),
    "generate_request": ("hybridflow.workers.rollout_worker", "RolloutWorker"),
    "save_rng_state": ("hybridflow.workers.rollout_worker", "RolloutWorker"),
    "load_into": ("engines.weight_sync.transfer", "WeightReceiver"),
}
HELD_AFTER = {"generate_sequences"}  # held with its tokens generated, its answer not returned


def hold(folder: Path, name: str, note: str = "") -> None:
    """Announce the held call `name` ("method.pid.n", `note` in its file), then wait until the test
    releases it, its method or every call (or kills the process)."""
    (folder / f"held-{name}").write_text(note)
    releases = [folder / f"release-{name}", folder / f"release-{name.split('.')[0]}", folder / "release"]
    while not any(release.exists() for release in releases):
        time.sleep(POLL_S)


def held(method, name: str, numbers: set[int | str]):
    """`method`, its calls numbered `numbers` (every one with "every", the armed one with "armed") held."""
    calls = itertools.count(1)

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        number, folder = next(calls), Path(os.environ[HOLD_DIR_ENV])
        counted = number in numbers or "every" in numbers
        if not counted and not ("armed" in numbers and took_the_arm(folder / f"arm-{name}")):
            return method(self, *args, **kwargs)
        label = f"{name}.{os.getpid()}.{number if counted else 'armed'}"
        if name not in HELD_AFTER:
            hold(folder, label)
            return method(self, *args, **kwargs)
        output = method(self, *args, **kwargs)
        hold(folder, label, generated(args[0], output))
        return output

    return wrapper


def generated(prompts, output) -> str:
    """A generation's held note, as JSON: the tokens it generated and its rows' prompts (their
    tokens, the padding left out)."""
    rows = zip(prompts.batch["input_ids"], prompts.batch["attention_mask"], strict=True)
    return json.dumps(
        {
            "tokens": int(output.batch["response_mask"].sum()),
            "prompts": [ids[mask.bool()].tolist() for ids, mask in rows],
        }
    )


def took_the_arm(arm: Path) -> bool:
    """Whether this process removed `arm`: one process does, however many call at once."""
    try:
        arm.unlink()
    except FileNotFoundError:
        return False
    return True


def held_calls(spec: str) -> dict[str, set[int | str]]:
    """The spec `save_rng_state:1,load_into:armed` -> {"save_rng_state": {1}, "load_into": {"armed"}}."""
    out: dict[str, set[int | str]] = {}
    for item in filter(None, spec.split(",")):
        method, number = item.split(":")
        out.setdefault(method, set()).add(number if number in ("armed", "every") else int(number))
    return out


class HoldOnImport(importlib.abc.MetaPathFinder):
    """Finds a held method's module as the path would, and wraps the method once the module ran."""

    def __init__(self, calls: dict[str, set[int]]):
        self.by_module: dict[str, list[tuple[str, str, set[int]]]] = {}
        for method, numbers in calls.items():
            module, cls = HELD_METHODS[method]
            self.by_module.setdefault(module, []).append((cls, method, numbers))

    def find_spec(self, name, path, target=None):
        if name not in self.by_module:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        run_module = spec.loader.exec_module

        def exec_module(module) -> None:
            run_module(module)
            for cls_name, method, numbers in self.by_module[name]:
                cls = getattr(module, cls_name)
                setattr(cls, method, held(getattr(cls, method), method, numbers))

        spec.loader.exec_module = exec_module
        return spec


if HOLD_DIR_ENV in os.environ:
    sys.meta_path.insert(0, HoldOnImport(held_calls(os.environ.get(HOLD_CALLS_ENV, ""))))
