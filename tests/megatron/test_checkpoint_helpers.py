"""Nothing a checkpoint save starts outlives the save: a process that saved two Megatron dist
checkpoints has no child process left (megatron-core would keep a Manager server, started with
the "spawn" context, for its write results; engines/megatron/checkpoint.py gives it an in-process
queue), so a SIGKILL of the saver leaves nothing behind."""

import os
import signal
import subprocess
import sys
import time

import psutil
from launch import REPO_ROOT, TESTS_MEGATRON_DIR


def wait_for(condition, timeout: float, interval: float = 0.2) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)
    return True


def test_checkpoint_saves_leave_no_helper_process(tmp_path):
    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "0",  # the only rank: its store binds a port of the OS's choice, no rank looks for it
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
    try:
        saved = wait_for(lambda: "SAVED" in log.read_text() or proc.poll() is not None, timeout=600)
        assert saved and proc.poll() is None, log.read_text()[-3000:]
        assert all((tmp_path / name / "metadata.json").is_file() for name in ("ckpt", "ckpt2"))
        left = [" ".join(child.cmdline()) for child in psutil.Process(proc.pid).children(recursive=True)]
        assert not left, f"processes the saves started are still running: {left}"
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
