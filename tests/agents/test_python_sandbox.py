"""The Python sandbox: it returns what the code prints; it cannot reach the network, write (or
read) outside its directory, or outlive its time limit. Each property is checked with every layer
that claims it, alone, and with no layer at all as the control: there the same code succeeds, so
the checks can tell a breach from a refusal."""

import asyncio
import json
import os
import re
import signal
import socket
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
from sandbox_runs import ALL, NO_LAYERS, needs_landlock_abi, run_code

from hybridflow.agents.tool_parser import parse_tool_calls, run_tool_calls
from hybridflow.agents.tools import PythonSandbox
from hybridflow.agents.tools import python_sandbox as sandbox_module

# The code's pid on the host: /proc is the host's, so this holds inside a PID namespace too.
PRINT_HOST_PID = "import os\nprint('pid', os.readlink('/proc/self'), flush=True)\n"


def host_pids(output: str) -> list[int]:
    return [int(pid) for pid in re.findall(r"pid (\d+)", output)]


def is_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_returns_what_the_code_prints():
    assert run_code("import sys\nprint(6 * 7)\nprint('to stderr', file=sys.stderr)") == "42\nto stderr\n"
    assert run_code("x = 1") == "[no output]"


def test_the_code_can_write_and_read_files_in_its_own_directory():
    code = textwrap.dedent("""
        import os
        open("a.txt", "w").write("kept")
        os.mkdir("d")
        print(open("a.txt").read(), os.listdir("."))
    """)
    assert run_code(code) == "kept ['main.py', 'a.txt', 'd']\n"


def test_an_error_shows_the_code_traceback_and_the_exit_code():
    output = run_code("print('before')\n1 / 0")
    assert output.startswith('before\nTraceback (most recent call last):\n  File "main.py", line 2')
    assert output.endswith("ZeroDivisionError: division by zero\n[exit code 1]")
    assert "sandbox_child" not in output
    assert run_code("import sys\nsys.exit(3)") == "[exit code 3]"
    assert run_code("x = (1,") == (
        "  File \"main.py\", line 1\n    x = (1,\n        ^\nSyntaxError: '(' was never closed\n[exit code 1]"
    )


def test_long_output_is_truncated():
    output = run_code("print('x' * 100_000)", max_output_chars=1000)
    assert output == "x" * 1000 + "\n[output truncated: the first 1000 characters of 100001 bytes]"


def test_memory_beyond_the_limit_raises_memory_error():
    output = run_code("x = bytearray(2 << 30)\nprint('allocated')", memory_mb=512)
    assert "MemoryError" in output and "allocated" not in output


@pytest.fixture
def listener():
    """A TCP socket of the test's own on 127.0.0.1; `connections()` counts what reached it."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.setblocking(False)

    def connections() -> int:
        count = 0
        while True:
            try:
                server.accept()[0].close()
            except BlockingIOError:
                return count
            count += 1

    yield server.getsockname()[1], connections
    server.close()


@pytest.mark.parametrize("layers", [ALL, ("namespaces",), ("landlock",), ("seccomp",), ("audit",)])
def test_cannot_connect_to_a_socket_of_the_host(listener, layers):
    needs_landlock_abi(layers, 4)
    port, connections = listener
    code = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=30)\nprint('CONNECTED')"
    output = run_code(code, layers=layers)
    assert "CONNECTED" not in output
    assert re.search(
        r"(PermissionError|OSError): .*(not allowed|not permitted|Permission denied|unreachable)", output
    )
    assert connections() == 0


def test_control_without_layers_the_same_code_connects(listener):
    port, connections = listener
    code = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=30)\nprint('CONNECTED')"
    assert run_code(code, layers=NO_LAYERS) == "CONNECTED\n"
    assert connections() == 1


@pytest.mark.parametrize("layers", [ALL, ("namespaces",), ("seccomp",), ("audit",)])
def test_cannot_send_udp_or_use_unix_sockets(layers, tmp_path):
    code = (
        "import socket\n"
        "for family, kind, address in ((socket.AF_INET, socket.SOCK_DGRAM, ('127.0.0.1', 9)),"
        f" (socket.AF_UNIX, socket.SOCK_STREAM, {str(tmp_path / 'host.sock')!r})):\n"
        "    try:\n"
        "        socket.socket(family, kind).connect(address)\n"
        "        print('CONNECTED')\n"
        "    except OSError as err:\n"
        "        print(type(err).__name__)\n"
    )
    host_socket = socket.socket(socket.AF_UNIX)
    host_socket.bind(str(tmp_path / "host.sock"))
    host_socket.listen()
    if layers == ("namespaces",):  # a unix socket is a file: only Landlock or seccomp stop it
        assert run_code(code, layers=layers).splitlines() == ["OSError", "CONNECTED"]
    else:
        assert "CONNECTED" not in run_code(code, layers=layers)
    host_socket.close()


@pytest.mark.parametrize("layers", [ALL, ("landlock",), ("audit",)])
def test_cannot_write_or_remove_outside_its_directory(layers, tmp_path):
    target, existing = tmp_path / "written_by_sandbox.txt", tmp_path / "owned_by_test.txt"
    existing.write_text("keep me")
    code = textwrap.dedent(f"""
        import os, pathlib
        for action in (
            lambda: open({str(target)!r}, "w").write("x"),
            lambda: pathlib.Path({str(target)!r}).write_text("x"),
            lambda: os.remove({str(existing)!r}),
        ):
            try:
                action()
                print("DONE")
            except OSError as err:
                print(type(err).__name__)
    """)
    assert run_code(code, layers=layers).splitlines() == ["PermissionError"] * 3
    assert not target.exists()
    assert existing.read_text() == "keep me"


def test_control_without_layers_the_same_write_happens(tmp_path):
    target = tmp_path / "written_by_sandbox.txt"
    assert run_code(f"open({str(target)!r}, 'w').write('x')\nprint('DONE')", layers=NO_LAYERS) == "DONE\n"
    assert target.read_text() == "x"


@pytest.mark.parametrize(("layers", "readable"), [(ALL, False), (("landlock",), False), (NO_LAYERS, True)])
def test_reads_outside_the_python_installation_are_refused(layers, readable, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("s3cret")
    output = run_code(f"print(open({str(secret)!r}).read())", layers=layers)
    assert ("s3cret" in output) is readable


def test_an_infinite_loop_is_killed_at_the_time_limit_and_leaves_no_process():
    output = run_code(PRINT_HOST_PID + "while True:\n    pass", timeout_s=10, cpu_s=600)
    assert output.endswith("\n[timed out after 10 s: the program was killed]")
    [pid] = host_pids(output)
    assert not is_running(pid)


def test_cpu_time_beyond_the_limit_kills_the_program():
    output = run_code("while True:\n    pass", timeout_s=600, cpu_s=1)
    assert output == "[killed: CPU time limit of 1 s reached]"


FORK_AND_DETACH = PRINT_HOST_PID + (
    "import time\n"
    "ready_r, ready_w = os.pipe()\n"
    "if os.fork() == 0:\n"
    "    try:\n"
    "        os.setsid()  # try to leave the process group the sandbox kills\n"
    "    except OSError as err:\n"
    "        print('setsid refused:', err.strerror, flush=True)\n"
    "    print('pid', os.readlink('/proc/self'), flush=True)\n"
    "    os.write(ready_w, b'1')\n"
    "    time.sleep(1000)\n"
    "os.read(ready_r, 1)\n"
)


@pytest.mark.parametrize("layers", [("namespaces", "landlock", "seccomp"), ("namespaces",), ("seccomp",)])
def test_a_process_left_running_is_killed_when_the_program_ends(layers):
    output = run_code(FORK_AND_DETACH, layers=layers)
    pids = host_pids(output)
    assert len(pids) == 2
    assert not any(is_running(pid) for pid in pids)
    assert ("setsid refused: Operation not permitted" in output) is ("seccomp" in layers)


def test_control_without_layers_a_detached_process_survives():
    output = run_code(FORK_AND_DETACH, layers=NO_LAYERS)
    _, grandchild = host_pids(output)
    try:
        assert is_running(grandchild)
    finally:
        os.kill(grandchild, signal.SIGKILL)


def test_audit_layer_refuses_subprocesses_and_foreign_calls():
    code = textwrap.dedent("""
        import ctypes, os, subprocess
        for action in (lambda: subprocess.run(["true"]), lambda: ctypes.CDLL(None), os.fork):
            try:
                action()
                print("RAN")
            except PermissionError as err:
                print(err)
    """)
    assert run_code(code, layers=("audit",)).splitlines() == [
        "sandbox: subprocess.Popen is not allowed",
        "sandbox: ctypes.dlopen is not allowed",
        "sandbox: os.fork is not allowed",
    ]


def test_a_cancelled_call_leaves_no_process(monkeypatch, tmp_path):
    """The agent loop's per-call timeout cancels the tool: its processes must go with it."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the sandbox's command line names it

    def sandbox_processes() -> list[str]:
        found = []
        for entry in Path("/proc").iterdir():
            try:
                if str(tmp_path) in (entry / "cmdline").read_text():
                    found.append(entry.name)
            except OSError:
                pass  # not a process, or one that just ended
        return found

    async def main():
        sandbox = PythonSandbox(timeout_s=600, cpu_s=600)
        task = asyncio.ensure_future(sandbox.call({"code": "while True:\n    pass"}))
        while not sandbox_processes():  # wait until the loop runs
            await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert sandbox_processes() == []


def test_run_tool_calls_reports_a_sandbox_result_as_the_tool_response():
    text = '<tool_call>\n{"name": "python", "arguments": {"code": "print(2 ** 10)"}}\n</tool_call>'
    [result] = asyncio.run(run_tool_calls(parse_tool_calls(text), [PythonSandbox()], timeout_s=60))
    assert (result.text, result.ok) == ("1024\n", True)


def test_the_constructor_works_inside_a_running_event_loop():
    async def build():
        return PythonSandbox(layers=["audit", "seccomp"])

    assert asyncio.run(build()).layers == ("seccomp", "audit")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"layers": ["namespaces", "chroot"]}, r"unknown \['chroot'\]; choose from"),
        ({"timeout_s": 0}, "timeout_s=0: must be a positive number"),
        ({"memory_mb": -1}, "memory_mb=-1: must be a positive number"),
    ],
)
def test_bad_settings_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PythonSandbox(**kwargs)


def test_a_layer_that_cannot_be_applied_stops_the_constructor(monkeypatch, tmp_path):
    """What the launcher reports when, say, Landlock is missing (a stand-in launcher here, since
    this kernel has it): the constructor names the layer and the layers that would work."""
    launcher = tmp_path / "launcher.py"
    error = {
        "error": "cannot apply sandbox layer 'landlock': [Errno 38] syscall 444: Function not implemented"
    }
    launcher.write_text(
        "import json, os, sys\n"
        "status_fd = json.loads(sys.argv[1])['status_fd']\n"
        f"os.write(status_fd, {json.dumps(error).encode()!r})\n"
    )
    monkeypatch.setattr(sandbox_module, "CHILD_SCRIPT", launcher)
    others = "\\['namespaces', 'seccomp', 'processes', 'audit'\\]"
    expected = f"layer 'landlock'.*To run with weaker isolation, pass layers={others}"
    with pytest.raises(RuntimeError, match=expected):
        PythonSandbox()


def test_the_sandbox_runs_with_the_parent_interpreter():
    assert run_code("import sys\nprint(sys.version)") == sys.version + "\n"


# Every way to start a process, each tried up to 3 times; the processes started sleep until the
# sandbox kills its process group when the program ends. Threads are not processes: one must still
# run. The program ends by itself ("done"): the call's timeout is only a bound, as wide as a busy
# machine needs to start nine interpreters (the timeout's own kill is tested above).
PROCESS_BOMB = textwrap.dedent("""
    import os, subprocess, sys, threading, time
    SLEEP = [sys.executable, "-c", "import time; time.sleep(600)"]

    def fork():
        pid = os.fork()
        if pid == 0:
            time.sleep(600)
        return pid

    def fork_exec():  # what subprocess calls, without its audit event (CPython 3.11's arguments)
        import _posixsubprocess

        exe = [os.fsencode(sys.executable)]
        r, w = os.pipe()
        no = (-1,) * 6
        return _posixsubprocess.fork_exec(
            SLEEP, exe, True, (w,), None, None, *no, r, w, False, False, -1, None, None, None, -1, None, True
        )

    ways = {
        "fork": fork,
        "fork_exec": fork_exec,
        "subprocess": lambda: subprocess.Popen(SLEEP).pid,
        "posix_spawn": lambda: os.posix_spawn(sys.executable, SLEEP, {}),
        "exec": lambda: os.execv(sys.executable, SLEEP),
    }
    for name, start in ways.items():
        for _ in range(3):
            try:
                print("started", name, start(), flush=True)
            except OSError as err:
                print("refused", name, err.strerror or err, flush=True)
                break
    thread = threading.Thread(target=lambda: print("a thread ran", flush=True))
    thread.start()
    thread.join()
    print("done", flush=True)
""")
BOMB_TIMEOUT_S = 300


@pytest.mark.parametrize("layers", [ALL, ("processes",)])
def test_a_fork_bomb_starts_no_process_and_nothing_is_left(layers):
    output = run_code(PRINT_HOST_PID + PROCESS_BOMB, layers=layers, timeout_s=BOMB_TIMEOUT_S)
    assert "started" not in output
    refused = [line.split(maxsplit=2)[1:] for line in output.splitlines() if line.startswith("refused")]
    assert [way for way, _ in refused] == ["fork", "fork_exec", "subprocess", "posix_spawn", "exec"]
    if "audit" not in layers:  # else the audit hook refuses first, all but fork_exec, which it misses
        assert {why for _, why in refused} == {"Operation not permitted"}
    assert "a thread ran" in output and output.endswith("done\n")
    [pid] = host_pids(output)
    assert not is_running(pid)


def test_control_without_layers_the_fork_bomb_starts_processes_the_sandbox_ends_them():
    output = run_code(
        PRINT_HOST_PID + PROCESS_BOMB.replace('"exec": ', '# "exec": '),
        layers=NO_LAYERS,
        timeout_s=BOMB_TIMEOUT_S,
    )
    started = [int(line.split()[-1]) for line in output.splitlines() if line.startswith("started")]
    assert len(started) == 12 and output.endswith("done\n")  # 3 forks, fork_execs, subprocesses, posix_spawns
    assert not any(is_running(pid) for pid in [*host_pids(output), *started])


# 120 MB held by each of as many processes as the code can start, and by 4 threads of its own;
# each process reports its peak resident memory.
MEMORY_BOMB = textwrap.dedent("""
    import os, resource, threading, time

    def hold(store):
        try:
            store.append(bytearray(120 << 20))
        except MemoryError:
            print("MemoryError", flush=True)

    def peak_mb():
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss >> 10

    report_r, report_w = os.pipe()
    children, store = 0, []
    try:
        for _ in range(4):
            if os.fork() == 0:
                hold(store)
                os.write(report_w, f"{peak_mb()}\\n".encode())
                time.sleep(600)
            children += 1
    except OSError as err:
        print("fork refused:", err.strerror or err, flush=True)
    threads = [threading.Thread(target=hold, args=(store,)) for _ in range(4)]
    [thread.start() for thread in threads]
    [thread.join() for thread in threads]
    reports = b""
    while reports.count(b"\\n") < children:
        reports += os.read(report_r, 4096)
    peaks = [peak_mb(), *map(int, reports.split())]
    print("processes", len(peaks), "total MB", sum(peaks), flush=True)
""")


def memory_report(output: str) -> tuple[int, int]:
    [(processes, total)] = re.findall(r"processes (\d+) total MB (\d+)", output)
    return int(processes), int(total)


@pytest.mark.parametrize("layers", [ALL, ("processes",)])
def test_a_memory_bomb_is_held_under_the_limit_in_one_process(layers):
    output = run_code(MEMORY_BOMB, layers=layers, memory_mb=256, timeout_s=BOMB_TIMEOUT_S)
    assert "fork refused:" in output and output.count("MemoryError") >= 2
    processes, total_mb = memory_report(output)
    assert processes == 1 and total_mb < 256


def test_control_without_layers_each_process_has_its_own_memory_limit():
    output = run_code(MEMORY_BOMB, layers=NO_LAYERS, memory_mb=256, timeout_s=BOMB_TIMEOUT_S)
    processes, total_mb = memory_report(output)
    assert processes == 5 and total_mb > 256


def test_the_processes_layer_is_refused_by_name_where_it_has_no_syscall_table():
    from hybridflow.agents.tools.sandbox_child import process_program

    with pytest.raises(OSError, match="no seccomp syscall table for architecture 'riscv64'"):
        process_program("riscv64")
