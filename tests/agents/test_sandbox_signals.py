"""The Python sandbox's code cannot signal, trace or read the memory of a process outside it: each
path (os.kill, pidfd_send_signal, tkill, tgkill, rt_sigqueueinfo, rt_tgsigqueueinfo through
ctypes, ptrace, process_vm_readv/writev, pidfd_getfd) is tried on processes the test started, and
on the test's own process with signal 0. Each layer that claims it is checked alone (seccomp is
the one left where user namespaces are unavailable); without layers, the control, every path works
and the targets die."""

import platform
import subprocess
import sys
import textwrap

import pytest
from sandbox_runs import ALL, NO_LAYERS, needs_landlock_abi, run_code

SIGNALS = ("kill", "pidfd_send_signal", "tkill", "tgkill", "rt_sigqueueinfo", "rt_tgsigqueueinfo")
MEMORY = ("ptrace", "process_vm_readv", "process_vm_writev", "pidfd_getfd")
ATTEMPTS = ("kill_test_process", *SIGNALS, *MEMORY)
SYSCALLS = {  # arch/x86/entry/syscalls/syscall_64.tbl, include/uapi/asm-generic/unistd.h
    "x86_64": dict(tkill=200, tgkill=234, rt_sigqueueinfo=129, rt_tgsigqueueinfo=297, ptrace=101),
    "aarch64": dict(tkill=130, tgkill=131, rt_sigqueueinfo=138, rt_tgsigqueueinfo=240, ptrace=117),
}
SYSCALLS["x86_64"] |= dict(process_vm_readv=310, process_vm_writev=311, pidfd_getfd=438)
SYSCALLS["aarch64"] |= dict(process_vm_readv=270, process_vm_writev=271, pidfd_getfd=438)
SECRET = b"SECRET42"
# a process holding SECRET at an address it prints
HOLDER = f"import ctypes, time\nb = ctypes.create_string_buffer({SECRET!r})\n"
HOLDER += "print(ctypes.addressof(b), flush=True)\ntime.sleep(600)\n"

ATTACK = """
import ctypes, os, signal, struct
TEST, T, HOLDER, ADDRESS, NR = {test_pid}, {targets}, {holder}, {address}, {numbers}

def syscall(name, *args):
    libc = ctypes.CDLL(None, use_errno=True)
    wide = [ctypes.c_long(a) if isinstance(a, int) else a for a in args]
    result = libc.syscall(ctypes.c_long(NR[name]), *wide)
    if result < 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
    return result

def siginfo():  # si_signo, si_errno, si_code = SI_QUEUE (what sigqueue sends)
    return ctypes.create_string_buffer(struct.pack("iii", signal.SIGKILL, 0, -1), 128)

def iovec(buffer):
    return struct.pack("QQ", ctypes.addressof(buffer), len(buffer))

def process_vm(name):
    reading = name.endswith("readv")
    local = ctypes.create_string_buffer(8) if reading else ctypes.create_string_buffer(b"OVERWRIT", 8)
    mine, theirs = ctypes.create_string_buffer(iovec(local)), struct.pack("QQ", ADDRESS, 8)
    count = syscall(name, HOLDER, mine, 1, ctypes.create_string_buffer(theirs), 1, 0)
    return local.raw if reading else count

ATTEMPTS = {{
    "kill_test_process": lambda: os.kill(TEST, 0),
    "kill": lambda: os.kill(T["kill"], signal.SIGKILL),
    "pidfd_send_signal": lambda: signal.pidfd_send_signal(
        os.pidfd_open(T["pidfd_send_signal"]), signal.SIGKILL
    ),
    "tkill": lambda: syscall("tkill", T["tkill"], signal.SIGKILL),
    "tgkill": lambda: syscall("tgkill", T["tgkill"], T["tgkill"], signal.SIGKILL),
    "rt_sigqueueinfo": lambda: syscall("rt_sigqueueinfo", T["rt_sigqueueinfo"], signal.SIGKILL, siginfo()),
    "rt_tgsigqueueinfo": lambda: syscall(
        "rt_tgsigqueueinfo", T["rt_tgsigqueueinfo"], T["rt_tgsigqueueinfo"], signal.SIGKILL, siginfo()
    ),
    "ptrace": lambda: syscall("ptrace", 0x4206, HOLDER, 0, 0),  # PTRACE_SEIZE: attach without stopping
    "process_vm_readv": lambda: process_vm("process_vm_readv"),
    "process_vm_writev": lambda: process_vm("process_vm_writev"),
    "pidfd_getfd": lambda: syscall("pidfd_getfd", os.pidfd_open(HOLDER), 1, 0),
}}
for name, attempt in ATTEMPTS.items():
    try:
        print(name, "done", attempt(), flush=True)
    except Exception as err:
        print(name, "refused", type(err).__name__, err, flush=True)
"""


@pytest.fixture
def targets():
    """One process per signalling path (each a would-be victim) and one holding SECRET in memory."""
    if platform.machine() not in SYSCALLS:
        pytest.skip(f"no syscall numbers for {platform.machine()} in this test")
    sleeper = [sys.executable, "-c", "import time; time.sleep(600)"]
    victims = {name: subprocess.Popen(sleeper) for name in SIGNALS}
    holder = subprocess.Popen([sys.executable, "-c", HOLDER], stdout=subprocess.PIPE, text=True)
    address = int(holder.stdout.readline())  # the holder is ready once it printed
    try:
        yield victims, holder, address
    finally:
        for process in [*victims.values(), holder]:
            process.kill()
            process.wait()


def attack(targets, layers) -> dict[str, str]:
    """What each attempt printed: 'done <result>' or 'refused <error>'."""
    victims, holder, address = targets
    import os

    code = ATTACK.format(
        test_pid=os.getpid(),
        targets={name: p.pid for name, p in victims.items()},
        holder=holder.pid,
        address=address,
        numbers=SYSCALLS[platform.machine()],
    )
    output = run_code(textwrap.dedent(code), layers=layers)
    lines = dict(line.split(" ", 1) for line in output.splitlines() if line.split(" ", 1)[0] in ATTEMPTS)
    assert set(lines) == set(ATTEMPTS), output
    return lines


@pytest.mark.parametrize("layers", [ALL, ("seccomp",), ("namespaces",), ("landlock",), ("audit",)])
def test_cannot_signal_trace_or_read_other_processes(targets, layers):
    needs_landlock_abi(layers, 6)
    lines = attack(targets, layers)
    done = {name: line for name, line in lines.items() if not line.startswith("refused")}
    assert not done, f"with layers={layers} the sandbox's code reached another process: {done}"
    victims, holder, _ = targets
    assert all(process.poll() is None for process in [*victims.values(), holder])


def test_control_without_layers_every_path_reaches_the_targets(targets):
    lines = attack(targets, NO_LAYERS)
    assert all(line.startswith("done") for line in lines.values()), lines
    assert lines["process_vm_readv"] == f"done {SECRET!r}"
    victims, _, _ = targets
    for process in victims.values():
        assert process.wait(timeout=10) == -9
