"""Runs in the checkpoint writer's Manager server (engines/megatron/checkpoint.py), a process
started with the "spawn" context: it exits once the worker that started it is gone.

A module of its own, importing nothing heavy: the spawned server imports the module that holds
its initializer, and importing Megatron-Core there would cost seconds per worker and print
Megatron's import-time warnings again, in a process the worker's warning filters do not reach.
"""

import os
import threading
import time


def exit_when_orphaned(parent_pid: int) -> None:
    """Exit once `parent_pid` is gone (the server is re-parented). A watch thread rather than
    PR_SET_PDEATHSIG, which fires when the *thread* that started the server ends, and a worker
    may save from a short-lived thread."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(0)

    threading.Thread(target=watch, daemon=True, name="exit-when-orphaned").start()
