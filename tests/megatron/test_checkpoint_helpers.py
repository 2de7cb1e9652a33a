"""Nothing a checkpoint save starts outlives its process: after SIGKILL of a process that saved a
Megatron dist checkpoint, every process it started (megatron-core's Manager server and the
multiprocessing resource_tracker) exits on its own."""

import os
import signal
import subprocess
import sys
import time

import psutil
from launch import REPO_ROOT, TESTS_MEGATRON_DIR, free_port


def wait_for(condition, timeout: float, interval: float = 0.2) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)
    return True


def test_checkpoint_helpers_die_with_the_process_that_saved(tmp_path):
    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "OMP_NUM_THREADS": "1",
        "PYTHONWARNINGS": "ignore",
        "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), str(TESTS_MEGATRON_DIR)]),
    }
    log = tmp_path / "saver.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, str(TESTS_MEGATRON_DIR / "_save_then_wait.py"), str(tmp_path)],
            env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    helpers = []
    try:
        saved = wait_for(lambda: "SAVED" in log.read_text() or proc.poll() is not None, timeout=600)
        assert saved and proc.poll() is None, log.read_text()[-3000:]
        helpers = psutil.Process(proc.pid).children(recursive=True)
        assert helpers, "the save started no helper process: nothing to check"
        proc.send_signal(signal.SIGKILL)  # the saver alone, as when a driver or worker is killed
        proc.wait()
        gone = wait_for(lambda: not any(h.is_running() and h.status() != "zombie" for h in helpers), 120)
        survivors = [" ".join(h.cmdline()) for h in helpers if h.is_running() and h.status() != "zombie"]
        assert gone, f"still running after the saver's SIGKILL: {survivors}"
    finally:
        os.killpg(proc.pid, signal.SIGKILL) if proc.poll() is None else None
        for helper in helpers:
            if helper.is_running():
                helper.kill()
