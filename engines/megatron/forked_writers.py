"""Processes forked during a checkpoint save die with the process that forked them.

megatron-core 0.16.1 forks one writer per file bucket and joins them within the save
(`write_preloaded_data_multiproc`, megatron/core/dist_checkpointing/strategies/filesystem_async.py).
When the saving worker is killed mid-save (SIGKILL, the OOM killer), an orphaned writer waits
forever on the queues it shares with its dead parent, and it holds the descriptors it inherited,
the worker's connection to Ray's raylet among them: Ray does not see the worker die until the
orphan exits. Measured 2026-11-29 (tiny GRPO run, trainer.restart_on_failure=1, the policy worker
SIGKILLed while a writer of its step-2 save ran): the restart began 443 s after the kill; with the
writers dying with it (below), 0.1 s.

Inside `forks_die_with_this_process()`, every process forked from this one asks the kernel to be
sent SIGKILL when the thread that forked it ends (prctl PR_SET_PDEATHSIG, Linux); Megatron's
saving thread joins its writers, so only the saver's death sets that off. Forks made outside the
block are left alone.
"""

import ctypes
import os
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager

PR_SET_PDEATHSIG = 1  # linux/prctl.h
_saver_pid: int | None = None  # while this process saves; a forked child inherits the value
_hook_registered = False


@contextmanager
def forks_die_with_this_process() -> Iterator[None]:
    """Processes forked inside the block are killed when this process dies (Linux only)."""
    global _saver_pid
    if sys.platform.startswith("linux"):
        _register_hook_once()
        _saver_pid = os.getpid()
    try:
        yield
    finally:
        _saver_pid = None


def _register_hook_once() -> None:
    global _hook_registered
    if not _hook_registered:
        os.register_at_fork(after_in_child=_die_with_the_saver)
        _hook_registered = True


def _die_with_the_saver() -> None:
    """Runs in each child forked from this process (os.register_at_fork)."""
    global _saver_pid
    if _saver_pid is None:
        return
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != _saver_pid:  # the saver died before the prctl took effect
        os._exit(1)
    _saver_pid = os.getpid()  # a process this child forks dies with the child
