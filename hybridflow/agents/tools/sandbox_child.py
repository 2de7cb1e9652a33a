"""The child side of the Python sandbox (python_sandbox.py): run as a script,

    python -I -B -u sandbox_child.py CONFIG_JSON

in a fresh working directory holding `main.py`. Standard library only and self-contained: `-I`
keeps PYTHONPATH and the user site out, so nothing of hybridflow can be imported here.

This process, the *launcher*, confines itself layer by layer (the layers named in the config, in
this order), then forks the process that runs `main.py`, which inherits every layer:
  namespaces  new user, network and PID namespaces: no capability on the host, no network
              interface but a loopback that is down, no host process visible by pid; the code runs
              as PID 1 of its namespace, so when it exits the kernel kills what it left running.
  limits      always: RLIMIT_CPU (SIGXCPU at the limit; SIGKILL a second later, for PID 1, which
              ignores SIGXCPU), RLIMIT_AS, RLIMIT_FSIZE, no core files.
  landlock    reads only under the Python installation and a few system paths, writes only in the
              working directory, TCP bind/connect denied (ABI >= 4), signals and abstract unix
              sockets scoped to the sandbox (ABI >= 6).
  seccomp     socket(2), socketpair(2) and io_uring_setup(2) fail with EPERM; setsid(2) and
              setpgid(2) too, so every process stays in the process group the parent kills; and
              every way to signal, trace or read another process (SECCOMP_DENIED).
  processes   (in the code's process, after the fork) a second seccomp filter: clone(2) without
              CLONE_THREAD, fork, vfork, execve and execveat fail with EPERM, clone3 with ENOSYS.
              The code runs as one process (threads allowed), so RLIMIT_AS bounds all its memory
              and no fork bomb can start, whatever Python-level path it takes.
  audit       (in the code's process, last) a sys.addaudithook hook that refuses sockets,
              process creation, signals, foreign calls through ctypes (the module itself stays
              importable: sympy needs its types) and writes outside the working directory; the
              pidfd signal functions, which raise no audit event, replaced by refusals.
The outcome goes to the parent as one JSON line on the status pipe: {"error": ...} when a layer
cannot be applied, else {"exit_code"|"signal": ..., "cpu_s": ...} once the code has ended.
"""

import ctypes
import json
import os
import platform
import resource
import struct
import sys
import traceback
import types

CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 38, 22, 2
# Landlock's three system calls have the same numbers on every architecture.
LANDLOCK_CREATE_RULESET, LANDLOCK_ADD_RULE, LANDLOCK_RESTRICT_SELF = 444, 445, 446
LANDLOCK_CREATE_RULESET_VERSION, LANDLOCK_RULE_PATH_BENEATH = 1, 1
# Landlock filesystem rights by the ABI version that introduced them (include/uapi/linux/landlock.h).
FS_EXECUTE, FS_WRITE_FILE, FS_READ_FILE, FS_READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
FS_RIGHTS_BY_ABI = {1: (1 << 13) - 1, 2: (1 << 14) - 1, 3: (1 << 15) - 1, 5: (1 << 16) - 1}
FS_FILE_RIGHTS = FS_EXECUTE | FS_WRITE_FILE | FS_READ_FILE | 1 << 14 | 1 << 15  # + truncate, ioctl_dev
NET_BIND_TCP, NET_CONNECT_TCP = 1 << 0, 1 << 1
SCOPE_ABSTRACT_UNIX_SOCKET, SCOPE_SIGNAL = 1 << 0, 1 << 1
READ_RIGHTS = FS_EXECUTE | FS_READ_FILE | FS_READ_DIR
SYSTEM_READ_PATHS = (
    "/usr",
    "/lib",
    "/lib64",
    "/bin",
    "/etc/ld.so.cache",
    "/etc/localtime",
    "/etc/passwd",
    "/etc/group",
    "/dev/urandom",
    "/dev/zero",
    "/proc/cpuinfo",
    "/proc/meminfo",
    "/sys/devices/system/cpu",
)
# seccomp: the calls the seccomp layer refuses, by name, with their numbers from
# arch/x86/entry/syscalls/syscall_64.tbl and include/uapi/asm-generic/unistd.h. Sockets; leaving
# the process group; signals to any process (the code's own too: the interpreter sends none);
# tracing, reading or writing another process's memory, or taking its file descriptors.
SECCOMP_DENIED = {
    "x86_64": dict(socket=41, socketpair=53, setsid=112, setpgid=109, io_uring_setup=425),
    "aarch64": dict(socket=198, socketpair=199, setsid=157, setpgid=154, io_uring_setup=425),
}
SECCOMP_DENIED["x86_64"] |= dict(kill=62, tkill=200, tgkill=234, rt_sigqueueinfo=129, rt_tgsigqueueinfo=297)
SECCOMP_DENIED["aarch64"] |= dict(kill=129, tkill=130, tgkill=131, rt_sigqueueinfo=138, rt_tgsigqueueinfo=240)
SECCOMP_DENIED["x86_64"] |= dict(pidfd_open=434, pidfd_send_signal=424, pidfd_getfd=438, ptrace=101)
SECCOMP_DENIED["aarch64"] |= dict(pidfd_open=434, pidfd_send_signal=424, pidfd_getfd=438, ptrace=117)
SECCOMP_DENIED["x86_64"] |= dict(process_vm_readv=310, process_vm_writev=311)
SECCOMP_DENIED["aarch64"] |= dict(process_vm_readv=270, process_vm_writev=271)
# (AUDIT_ARCH_*, the numbers of the denied calls)
SECCOMP_ARCHES = {
    "x86_64": (0xC000003E, tuple(SECCOMP_DENIED["x86_64"].values())),
    "aarch64": (0xC00000B7, tuple(SECCOMP_DENIED["aarch64"].values())),
}
# the processes layer: (clone, clone3, the calls refused outright: fork, vfork, execve, execveat)
PROCESS_SYSCALLS = {"x86_64": (56, 435, (57, 58, 59, 322)), "aarch64": (220, 435, (221, 281))}
CLONE_THREAD = 0x00010000
X32_SYSCALL_BIT = 0x40000000
BPF_LD_W_ABS, BPF_JEQ_K, BPF_JGE_K, BPF_JSET_K, BPF_RET_K = 0x20, 0x15, 0x35, 0x45, 0x06
SECCOMP_RET_KILL_PROCESS, SECCOMP_RET_ERRNO, SECCOMP_RET_ALLOW = 0x80000000, 0x00050000, 0x7FFF0000
EPERM, ENOSYS = 1, 38
SECCOMP_DATA_ARG0 = 16  # offsetof(struct seccomp_data, args[0]), its low 32 bits on little-endian

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def _checked(result: int, what: str) -> int:
    if result < 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")
    return result


def _syscall(number: int, *args) -> int:
    # syscall(2) is variadic: pass every integer as a full long, never as a 32-bit int.
    wide = [ctypes.c_long(a) if isinstance(a, int) else a for a in args]
    return _checked(_libc.syscall(ctypes.c_long(number), *wide), f"syscall {number}")


def enter_namespaces(config: dict) -> None:
    """New user + network + PID namespaces. The user namespace maps our own uid and gid onto
    themselves, so files keep their owner while every capability on the host is gone."""
    uid, gid = os.geteuid(), os.getegid()
    _checked(_libc.unshare(CLONE_NEWUSER | CLONE_NEWNET | CLONE_NEWPID), "unshare")
    for name, line in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
        with open(f"/proc/self/{name}", "w") as file:
            file.write(line)


def set_limits(config: dict) -> None:
    # SIGXCPU at cpu_s; PID 1 of a namespace ignores it, so SIGKILL one second later
    resource.setrlimit(resource.RLIMIT_CPU, (config["cpu_s"], config["cpu_s"] + 1))
    resource.setrlimit(resource.RLIMIT_AS, (config["memory_bytes"],) * 2)
    resource.setrlimit(resource.RLIMIT_FSIZE, (config["max_file_bytes"],) * 2)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def landlock_abi() -> int:
    return _syscall(LANDLOCK_CREATE_RULESET, None, 0, LANDLOCK_CREATE_RULESET_VERSION)


def _ruleset_attr(abi: int) -> tuple[bytes, int]:
    fs = FS_RIGHTS_BY_ABI[max(v for v in FS_RIGHTS_BY_ABI if v <= abi)]
    net = NET_BIND_TCP | NET_CONNECT_TCP if abi >= 4 else 0
    scoped = SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL if abi >= 6 else 0
    size = 24 if abi >= 6 else 16 if abi >= 4 else 8  # the struct grew with the ABI
    return struct.pack("QQQ", fs, net, scoped)[:size], fs


def _allow_beneath(ruleset_fd: int, path: str, rights: int) -> None:
    try:
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    except FileNotFoundError:
        return  # e.g. no /lib64 on this architecture: nothing there to allow
    try:
        if not os.path.isdir(path):
            rights &= FS_FILE_RIGHTS  # a rule on a file may only carry file rights
        attr = ctypes.create_string_buffer(struct.pack("=Qi", rights, fd), 12)
        _syscall(LANDLOCK_ADD_RULE, ruleset_fd, LANDLOCK_RULE_PATH_BENEATH, attr, 0)
    finally:
        os.close(fd)


def _read_paths() -> list[str]:
    prefixes = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    return sorted(prefixes) + list(SYSTEM_READ_PATHS)


def apply_landlock(config: dict) -> None:
    """Reads under the Python installation and SYSTEM_READ_PATHS, everything in the working
    directory, /dev/null read-write; nothing else, no TCP."""
    attr, handled = _ruleset_attr(landlock_abi())
    ruleset = ctypes.create_string_buffer(attr, len(attr))
    ruleset_fd = _syscall(LANDLOCK_CREATE_RULESET, ruleset, len(attr), 0)
    try:
        for path in _read_paths():
            _allow_beneath(ruleset_fd, path, READ_RIGHTS & handled)
        _allow_beneath(ruleset_fd, "/dev/null", FS_FILE_RIGHTS & handled)
        _allow_beneath(ruleset_fd, config["workdir"], handled)
        _checked(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(NO_NEW_PRIVS)")
        _syscall(LANDLOCK_RESTRICT_SELF, ruleset_fd, 0)
    finally:
        os.close(ruleset_fd)


def _bpf(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("HBBI", code, jt, jf, k)


def seccomp_program(machine: str) -> bytes:
    """Kill a foreign-architecture call; EPERM for the denied calls (and x32 ones); allow the rest."""
    if machine not in SECCOMP_ARCHES:
        raise OSError(38, f"no seccomp syscall table for architecture {machine!r}")
    arch, denied = SECCOMP_ARCHES[machine]
    program = [_bpf(BPF_LD_W_ABS, 4), _bpf(BPF_JEQ_K, arch, jt=1), _bpf(BPF_RET_K, SECCOMP_RET_KILL_PROCESS)]
    program.append(_bpf(BPF_LD_W_ABS, 0))
    if machine == "x86_64":
        program.append(_bpf(BPF_JGE_K, X32_SYSCALL_BIT, jt=len(denied) + 1))
    # each jump skips the remaining comparisons and the ALLOW to land on the ERRNO return
    program += [_bpf(BPF_JEQ_K, nr, jt=len(denied) - i) for i, nr in enumerate(denied)]
    program += [_bpf(BPF_RET_K, SECCOMP_RET_ALLOW), _bpf(BPF_RET_K, SECCOMP_RET_ERRNO | EPERM)]
    return b"".join(program)


def process_program(machine: str) -> bytes:
    """Threads only: clone() without CLONE_THREAD, fork, vfork, execve and execveat fail with
    EPERM; clone3() with ENOSYS, since its flags are in memory a filter cannot read (glibc then
    creates threads with clone()). A foreign architecture's calls kill the process."""
    if machine not in PROCESS_SYSCALLS:
        raise OSError(38, f"no seccomp syscall table for architecture {machine!r}")
    arch, _ = SECCOMP_ARCHES[machine]
    clone, clone3, refused = PROCESS_SYSCALLS[machine]
    n = len(refused)
    program = [_bpf(BPF_LD_W_ABS, 4), _bpf(BPF_JEQ_K, arch, jt=1), _bpf(BPF_RET_K, SECCOMP_RET_KILL_PROCESS)]
    program.append(_bpf(BPF_LD_W_ABS, 0))
    if machine == "x86_64":  # x32 calls: refused
        program.append(_bpf(BPF_JGE_K, X32_SYSCALL_BIT, jt=n + 6))
    program += [_bpf(BPF_JEQ_K, clone3, jf=1), _bpf(BPF_RET_K, SECCOMP_RET_ERRNO | ENOSYS)]
    # clone: allowed when its flags (argument 0) hold CLONE_THREAD; jumps land on ALLOW or EPERM
    program += [_bpf(BPF_JEQ_K, clone, jf=2), _bpf(BPF_LD_W_ABS, SECCOMP_DATA_ARG0)]
    program.append(_bpf(BPF_JSET_K, CLONE_THREAD, jt=n, jf=n + 1))
    program += [_bpf(BPF_JEQ_K, nr, jt=n - i) for i, nr in enumerate(refused)]
    program += [_bpf(BPF_RET_K, SECCOMP_RET_ALLOW), _bpf(BPF_RET_K, SECCOMP_RET_ERRNO | EPERM)]
    return b"".join(program)


class _SockFprog(ctypes.Structure):
    _fields_ = (("len", ctypes.c_ushort), ("filter", ctypes.c_void_p))


def apply_seccomp(config: dict) -> None:
    _install_filter(seccomp_program(platform.machine()))


def limit_processes() -> None:
    """The processes layer, in the code's process: it cannot start another."""
    _install_filter(process_program(platform.machine()))


def _install_filter(program: bytes) -> None:
    filters = ctypes.create_string_buffer(program, len(program))
    fprog = _SockFprog(len(program) // 8, ctypes.addressof(filters))
    _checked(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(NO_NEW_PRIVS)")
    _checked(_libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0), "prctl(SECCOMP)")


KERNEL_LAYERS = {"namespaces": enter_namespaces, "landlock": apply_landlock, "seccomp": apply_seccomp}

AUDIT_REFUSED = ("socket.", "subprocess.", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork")
AUDIT_REFUSED += ("os.forkpty", "os.kill", "os.killpg", "pty.", "ctypes.")
AUDIT_FILE_EVENTS = {"os.remove", "os.rename", "os.mkdir", "os.rmdir", "os.chmod", "os.chown", "os.link"}
AUDIT_FILE_EVENTS |= {"os.symlink", "os.truncate", "os.utime", "os.setxattr", "os.removexattr"}
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC


def _audit_hook(workdir: str):
    root = os.path.realpath(workdir)

    def inside(path) -> bool:
        real = os.path.realpath(os.fsdecode(path))
        return real in (root, "/dev/null") or real.startswith(root + os.sep)

    def hook(event: str, args: tuple) -> None:
        if event.startswith(AUDIT_REFUSED):
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event == "open" and isinstance(args[0], str | bytes | os.PathLike) and args[2] & WRITE_FLAGS:
            paths = [args[0]]
        elif event in AUDIT_FILE_EVENTS:
            paths = [a for a in args if isinstance(a, str | bytes | os.PathLike)]
        else:
            return
        outside = [p for p in paths if not inside(p)]
        if outside:
            raise PermissionError(f"sandbox: {event} of {os.fsdecode(outside[0])!r} is outside the sandbox")

    return hook


def _remove_unaudited_signals() -> None:
    """os.pidfd_open and signal.pidfd_send_signal signal another process without an audit event,
    so the audit layer replaces them with functions that refuse."""
    import signal

    def refused(event: str):
        def refuse(*args, **kwargs):
            raise PermissionError(f"sandbox: {event} is not allowed")

        return refuse

    os.pidfd_open = refused("os.pidfd_open")
    signal.pidfd_send_signal = refused("signal.pidfd_send_signal")


def run_code(config: dict) -> None:
    """Runs main.py as the __main__ module; a traceback leaves out this file's frames."""
    sys.argv = ["main.py"]
    if "audit" in config["layers"]:
        sys.addaudithook(_audit_hook(config["workdir"]))
        _remove_unaudited_signals()
    module = types.ModuleType("__main__")
    module.__file__ = "main.py"
    sys.modules["__main__"] = module
    try:
        with open("main.py", encoding="utf-8") as file:
            exec(compile(file.read(), "main.py", "exec"), module.__dict__)
    except Exception as err:
        report = traceback.TracebackException.from_exception(err)
        report.stack = traceback.StackSummary.from_list([f for f in report.stack if f.filename != __file__])
        print("".join(report.format()), end="", file=sys.stderr)
        sys.exit(1)


def _report(status, **fields) -> None:
    status.write(json.dumps(fields) + "\n")
    status.flush()


def _wait_and_report(pid: int, status) -> None:
    _, wait_status, usage = os.wait4(pid, 0)
    cpu_s = usage.ru_utime + usage.ru_stime
    if os.WIFSIGNALED(wait_status):
        _report(status, signal=os.WTERMSIG(wait_status), cpu_s=cpu_s)
    else:
        _report(status, exit_code=os.waitstatus_to_exitcode(wait_status), cpu_s=cpu_s)


def _confine(config: dict, status) -> None:
    steps = {"limits": set_limits} | {
        layer: KERNEL_LAYERS[layer] for layer in config["layers"] if layer in KERNEL_LAYERS
    }
    for name in ("namespaces", "limits", "landlock", "seccomp"):
        try:
            if name in steps:
                steps[name](config)
        except (OSError, ValueError) as err:
            _report(status, error=f"cannot apply sandbox layer {name!r}: {err}")
            os._exit(1)


def main() -> None:
    config = json.loads(sys.argv[1])
    status = os.fdopen(config["status_fd"], "w")
    _confine(config, status)
    pid = os.fork()
    if pid == 0:
        _confine_code(config, status)
        status.close()  # the code must not be able to forge its own outcome
        run_code(config)
        return
    _wait_and_report(pid, status)


def _confine_code(config: dict, status) -> None:
    """The processes layer, in the code's process (the launcher needs fork for it). A failure is
    reported before the launcher's own report, which the parent then ignores."""
    if "processes" not in config["layers"]:
        return
    try:
        limit_processes()
    except OSError as err:
        _report(status, error=f"cannot apply sandbox layer 'processes': {err}")
        os._exit(1)


if __name__ == "__main__":
    main()
