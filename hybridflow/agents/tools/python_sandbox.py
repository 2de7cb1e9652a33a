"""`PythonSandbox`: a tool that runs model-written Python in a confined subprocess and returns what
it printed.

Each call gets a fresh temporary directory (its cwd, HOME and TMPDIR, deleted afterwards) and runs
`python -I -B -u sandbox_child.py` there with a minimal environment (no inherited variables, so
no tokens or keys). The child confines itself before the code runs; see sandbox_child.py for how.
What is enforced, by layer (`layers=`; all five by default):

  always       wall-clock timeout: the whole process group is SIGKILLed and the result says
               "timed out"; RLIMIT_CPU (killed at `cpu_s`, a second later when the code is PID 1
               of its namespace), RLIMIT_AS (`memory_mb`: allocations beyond it raise
               MemoryError), RLIMIT_FSIZE (`max_file_mb` per file), no core files; stdout and
               stderr together cut to `max_output_chars`.
  namespaces   kernel: new user, network and PID namespaces. No host capability (root in the
               parent does not make the code root on the host), no network interface but a
               down loopback, host processes invisible to kill/ptrace/setpriority; when the code
               exits or is killed, the kernel kills every process it started.
  landlock     kernel (Landlock LSM): writes only inside the temporary directory (and
               /dev/null); reads only under the Python installation (sys.prefix,
               sys.base_prefix) and system library paths, so no home directories, data sets or
               checkpoints; TCP bind/connect denied (Landlock ABI >= 4); signals and abstract unix
               sockets limited to the sandbox (ABI >= 6).
  seccomp      kernel (seccomp-BPF, x86_64 and aarch64): socket(), socketpair() and io_uring
               fail with EPERM, so no TCP, UDP or unix-socket traffic at all; setsid() and
               setpgid() fail, so no process leaves the group the timeout kills; no signal to
               any process (kill, tkill, tgkill, rt_(tg)sigqueueinfo, pidfd_open,
               pidfd_send_signal), no ptrace, process_vm_readv/writev or pidfd_getfd.
  processes    kernel (a seccomp-BPF filter in the code's process): no new process, by any path
               (fork, subprocess, _posixsubprocess.fork_exec, posix_spawn, exec): EPERM; threads
               run. The call is one process, so RLIMIT_AS bounds its memory in all (threads
               share it) and a fork bomb starts nothing.
  audit        Python (sys.addaudithook in the code's process): sockets, subprocesses, fork,
               exec, kill, foreign calls through ctypes and file writes, renames and removals
               outside the directory raise PermissionError; os.pidfd_open and
               signal.pidfd_send_signal (which raise no audit event) are replaced by refusals. A
               clear message for the model, and the only layer left where the kernel ones are
               unavailable; on its own it is not a security boundary (`_posixsubprocess.fork_exec`
               raises no audit event).

The constructor runs an empty program with the chosen layers and raises if one cannot be applied
here (no user namespaces in a container, a kernel without Landlock), naming it: pass a `layers`
list without it to run with the others. Without the processes layer, the code can start processes
(the audit hook misses `_posixsubprocess.fork_exec`), each with its own RLIMIT_AS, until the
timeout kills the group; without both namespaces and seccomp, such a process can also leave the
group with setsid() and outlive the call. Not enforced by any layer: the total disk use of the
directory (each file is capped, their number is not).
"""

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import math
import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal, get_args

Layer = Literal["namespaces", "landlock", "seccomp", "processes", "audit"]
ALL_LAYERS: tuple[Layer, ...] = get_args(Layer)
CHILD_SCRIPT = Path(__file__).with_name("sandbox_child.py")
GROUP_EXIT_WAIT_S, GROUP_EXIT_POLL_S = 10.0, 0.01
ESCAPED_OUTPUT_WAIT_S = 2.0
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SandboxRun:
    """What one run left: the first bytes of its output, how many there were in all, whether the
    wall-clock timeout killed it, and the launcher's report (empty when it was killed)."""

    output: bytes
    total_bytes: int
    timed_out: bool
    status: dict[str, Any]


class PythonSandbox:
    """Runs the `code` argument as a Python 3 program in a sandbox; returns its printed output."""

    name = "python"
    parameters: ClassVar[dict[str, Any]] = {
        "type": "object",
        "properties": {"code": {"type": "string", "description": "A complete Python 3 program."}},
        "required": ["code"],
        "additionalProperties": False,
    }

    def __init__(
        self,
        timeout_s: float = 10.0,
        cpu_s: int = 10,
        memory_mb: int = 1024,
        max_output_chars: int = 4000,
        max_file_mb: int = 16,
        layers: tuple[Layer, ...] | list[Layer] = ALL_LAYERS,
    ):
        _check_positive(timeout_s=timeout_s, cpu_s=cpu_s, memory_mb=memory_mb)
        _check_positive(max_output_chars=max_output_chars, max_file_mb=max_file_mb)
        unknown = [layer for layer in layers if layer not in ALL_LAYERS]
        if unknown:
            raise ValueError(
                f"PythonSandbox layers={list(layers)}: unknown {unknown}; choose from {ALL_LAYERS}"
            )
        self.timeout_s, self.cpu_s, self.memory_mb = timeout_s, int(cpu_s), int(memory_mb)
        self.max_output_chars, self.max_file_mb = int(max_output_chars), int(max_file_mb)
        self.layers = tuple(layer for layer in ALL_LAYERS if layer in layers)
        self.description = (
            "Run a Python 3 program and return what it prints (stdout and stderr). No network, no "
            f"files outside a fresh temporary directory, {timeout_s:g} s time limit, "
            f"{self.memory_mb} MB memory. Print every value you need."
        )
        self._check_layers_apply()

    async def call(self, arguments: dict[str, Any]) -> str:
        run = await self._run(arguments["code"])
        if "error" in run.status:
            raise RuntimeError(f"the sandbox could not start: {run.status['error']}")
        return self._describe(run)

    async def _run(self, code: str) -> SandboxRun:
        # the directory's creation and removal, the start and the reaping run in threads: every
        # row's loop and the engine's steps share this event loop
        workdir = await asyncio.to_thread(tempfile.TemporaryDirectory, prefix="hybridflow-sandbox-")
        try:
            process, status_fd = await self._start(code, workdir.name)
            return await _supervise(process, status_fd, self.timeout_s, 4 * self.max_output_chars)
        finally:
            await asyncio.shield(asyncio.to_thread(workdir.cleanup))

    async def _start(self, code: str, workdir: str) -> tuple[subprocess.Popen, int]:
        """`_spawn` in a thread. Cancelled meanwhile, the call still waits for the start, then
        kills what it started."""
        starting = asyncio.ensure_future(asyncio.to_thread(self._spawn, code, workdir))
        try:
            return await asyncio.shield(starting)
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                process, status_fd = await starting
                os.close(status_fd)
                await _kill_group(process)
                await _group_gone(process.pid)
            raise

    def _config(self, workdir: str, status_fd: int) -> dict[str, Any]:
        return {
            "workdir": workdir,
            "status_fd": status_fd,
            "layers": list(self.layers),
            "cpu_s": self.cpu_s,
            "memory_bytes": self.memory_mb << 20,
            "max_file_bytes": self.max_file_mb << 20,
        }

    def _spawn(self, code: str, workdir: str) -> tuple[subprocess.Popen, int]:
        """Starts the child in its own process group (its pid is the group id); returns it and the
        read end of its status pipe."""
        Path(workdir, "main.py").write_text(code, encoding="utf-8")
        status_r, status_w = os.pipe()
        config = json.dumps(self._config(workdir, status_w))
        try:
            process = subprocess.Popen(
                [sys.executable, "-I", "-B", "-u", str(CHILD_SCRIPT), config],
                cwd=workdir,
                env=_child_env(workdir),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                pass_fds=(status_w,),
            )
        except BaseException:
            os.close(status_r)
            raise
        finally:
            os.close(status_w)
        return process, status_r

    def _check_layers_apply(self) -> None:
        """Runs an empty program the way `call` runs code; in a thread of its own, since the
        constructor may be called from inside a running event loop."""
        with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
            run = pool.submit(asyncio.run, self._run("pass")).result()
        if run.timed_out or run.status.get("exit_code") != 0:
            problem = "an empty program timed out" if run.timed_out else run.status.get("error", run.status)
            others = [layer for layer in self.layers if layer not in str(problem)]
            raise RuntimeError(
                f"PythonSandbox cannot run with layers={list(self.layers)} on this machine: {problem}. "
                f"To run with weaker isolation, pass layers={others}"
            )

    def _describe(self, run: SandboxRun) -> str:
        """The output, cut to max_output_chars, then one line on how the program ended unless it
        exited with 0."""
        text = run.output.decode("utf-8", errors="replace")
        if len(text) > self.max_output_chars or len(run.output) < run.total_bytes:
            text = (
                f"{text[: self.max_output_chars]}\n[output truncated: the first "
                f"{self.max_output_chars} characters of {run.total_bytes} bytes]"
            )
        ending = self._ending(run)
        if ending:
            text = f"{text.rstrip()}\n{ending}" if text else ending
        return text or "[no output]"

    def _ending(self, run: SandboxRun) -> str:
        status = run.status
        if run.timed_out:
            return f"[timed out after {self.timeout_s:g} s: the program was killed]"
        if status.get("signal") == signal.SIGXCPU or (
            status.get("signal") == signal.SIGKILL and status["cpu_s"] >= self.cpu_s
        ):
            return f"[killed: CPU time limit of {self.cpu_s} s reached]"
        if "signal" in status:
            return f"[killed by signal {signal.Signals(status['signal']).name}]"
        if not status:  # the launcher was killed, by the code when no layer hides it
            return "[ended without an exit status]"
        return f"[exit code {status['exit_code']}]" if status.get("exit_code") else ""


def _check_positive(**values: float) -> None:
    for key, value in values.items():
        if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
            raise ValueError(f"PythonSandbox {key}={value!r}: must be a positive number")


def _child_env(workdir: str) -> dict[str, str]:
    # Nothing inherited: the parent's environment may hold tokens. One thread per numeric library,
    # since the sandbox's CPU time is the sum over its threads.
    threads = {name: "1" for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}
    return {"PATH": "/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8", **threads}


async def _supervise(
    process: subprocess.Popen, status_fd: int, timeout_s: float, max_bytes: int
) -> SandboxRun:
    """Waits for the launcher to exit (at most timeout_s), then kills its process group whatever
    happened, cancellation included, so that nothing it started outlives the call."""
    output = _CappedOutput(max_bytes)
    try:
        reading = asyncio.ensure_future(output.read_to_end(process.stdout))
        try:
            exited = await _exits_within(process.pid, timeout_s)
        finally:
            await _kill_group(process)
            await _group_gone(process.pid)
        await _drain(reading)
        return SandboxRun(bytes(output.kept), output.total, not exited, _read_status(status_fd))
    finally:
        os.close(status_fd)


@dataclass
class _CappedOutput:
    """The first max_bytes of a pipe and how many bytes it carried in all."""

    max_bytes: int
    kept: bytearray = field(default_factory=bytearray)
    total: int = 0

    async def read_to_end(self, pipe) -> None:
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader()
        transport, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), pipe)
        try:
            while chunk := await reader.read(1 << 16):
                self.total += len(chunk)
                self.kept += chunk[: self.max_bytes - len(self.kept)]
        finally:
            transport.close()


async def _drain(reading: asyncio.Future) -> None:
    """The pipe ends once the group is gone, unless a process left the group (setsid() without
    the namespaces and seccomp layers) and holds it: then keep what was read and stop."""
    done, _ = await asyncio.wait([reading], timeout=ESCAPED_OUTPUT_WAIT_S)
    if not done:
        reading.cancel()
        logger.warning("a process that left the sandbox's process group still holds its output")


async def _exits_within(pid: int, timeout_s: float) -> bool:
    """True once `pid` has exited (a pidfd becomes readable; the process is not reaped, so its pid,
    the group id, cannot be reused before _kill_group), False after timeout_s."""
    loop = asyncio.get_running_loop()
    exited = loop.create_future()
    pidfd = os.pidfd_open(pid)
    loop.add_reader(pidfd, lambda: exited.done() or exited.set_result(None))
    try:
        done, _ = await asyncio.wait([exited], timeout=timeout_s)
        return bool(done)
    finally:
        loop.remove_reader(pidfd)
        os.close(pidfd)


async def _kill_group(process: subprocess.Popen) -> None:
    """SIGKILLs the launcher's process group, then reaps the launcher (in a thread, which goes on
    reaping if the call is cancelled meanwhile)."""
    with contextlib.suppress(ProcessLookupError):  # every process of the group has exited
        os.killpg(process.pid, signal.SIGKILL)
    await asyncio.shield(asyncio.to_thread(process.wait))


async def _group_gone(pgid: int) -> None:
    """Returns once no process of the group is left, reaped ones included: SIGKILL is delivered
    asynchronously, and orphans are reaped by the machine's init. Gives up, with a warning, after
    GROUP_EXIT_WAIT_S (an init that never reaps, as in some containers)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + GROUP_EXIT_WAIT_S
    while loop.time() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        await asyncio.sleep(GROUP_EXIT_POLL_S)
    logger.warning("sandbox process group %d still has processes %g s after SIGKILL", pgid, GROUP_EXIT_WAIT_S)


def _read_status(status_fd: int) -> dict[str, Any]:
    """The launcher's one-line JSON report; {} when it was killed before writing one. Read without
    blocking: the group is gone, so what it wrote is in the pipe, and an unrelated fork of this
    process holding the write end must not stall the event loop."""
    os.set_blocking(status_fd, False)
    chunks = []
    with contextlib.suppress(BlockingIOError):
        while chunk := os.read(status_fd, 1 << 16):
            chunks.append(chunk)
    lines = b"".join(chunks).splitlines()
    return json.loads(lines[0]) if lines else {}  # the first: a layer the code's process lacks
