"""What the benchmarks share: the median time of a call after a warm-up, and torchrun launches.

`median_seconds(fn, repeats, sync=None)` times `fn` (`timed_calls` gives each call's time; the
warm-up call pays first-call costs: imports, allocations, a worker group's layout query).
`run_torchrun(script, nproc, *args, what=...)` runs a benchmark's worker script on `nproc` local
processes (OMP_NUM_THREADS=1 each) and raises RuntimeError with the output's tail when any rank
fails.
"""

import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def median_seconds(fn: Callable[[], object], repeats: int, sync: Callable[[], None] | None = None) -> float:
    """Median wall time of `repeats` calls after one warm-up call. `sync` (e.g.
    `torch.cuda.synchronize`) runs on both sides of each timed call, so queued device work counts."""
    return statistics.median(timed_calls(fn, repeats, sync))


def timed_calls(
    fn: Callable[[], object], repeats: int, sync: Callable[[], None] | None = None
) -> list[float]:
    """The wall time of each of `repeats` calls after one warm-up call (see `median_seconds`)."""
    fn()
    times = []
    for _ in range(repeats):
        if sync is not None:
            sync()
        start = time.perf_counter()
        fn()
        if sync is not None:
            sync()
        times.append(time.perf_counter() - start)
    return times


def run_torchrun(script: str, nproc: int, *args, what: str, timeout: float = 900) -> None:
    """`python -m torch.distributed.run --nproc_per_node nproc script *args` on this host."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)}
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
        "--master_addr", "127.0.0.1", "--master_port", str(_free_port()),
        script, *[str(a) for a in args],
    ]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{what} failed:\n{(proc.stdout + proc.stderr)[-4000:]}")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
