"""engines/megatron/forked_writers.py: a process forked inside `forks_die_with_this_process()`
(as megatron-core forks its checkpoint writers) is killed when the forking process dies; one
forked outside the block outlives it. The killed-mid-save restart end to end:
tests/test_restart_on_failure.py."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
# Forks two sleepers, the first inside the block, prints their pids, then waits to be killed.
PARENT = """
import multiprocessing, time
from engines.megatron.forked_writers import forks_die_with_this_process
fork = multiprocessing.get_context("fork")
with forks_die_with_this_process():
    inside = fork.Process(target=time.sleep, args=(600,))
    inside.start()
outside = fork.Process(target=time.sleep, args=(600,))
outside.start()
print(inside.pid, outside.pid, flush=True)
time.sleep(600)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_fork_inside_the_block_dies_with_its_parent_and_one_outside_does_not():
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT], cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )  # fmt: skip
    inside_pid, outside_pid = (int(pid) for pid in parent.stdout.readline().split())
    inside, outside = psutil.Process(inside_pid), psutil.Process(outside_pid)
    try:
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        inside.wait(timeout=120)  # raises psutil.TimeoutExpired while it lives on
        assert outside.is_running() and outside.status() != psutil.STATUS_ZOMBIE
    finally:
        for child in (inside, outside):
            if child.is_running():
                child.kill()
