"""An OpenEnv environment server in a process of its own, for a test's length.

`openenv_server(app, env)` starts `python` serving the FastAPI app `module:attribute` (an
environment made with OpenEnv's `create_app`) with uvicorn, as OpenEnv's own `server.app:main`
does, on 127.0.0.1. The child binds port 0 itself, listens, prints the port and hands the
listening socket to uvicorn, so no other process can take the port between choosing and serving
it. The parent reads the port, waits for `/health` to answer (every wait with a deadline), yields
the base URL, and ends the process afterwards."""

import contextlib
import json
import os
import select
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

HERE = Path(__file__).resolve().parent
START_DEADLINE_S = 60.0  # the child imports fastapi, openenv and the environment, then serves
STOP_DEADLINE_S = 10.0

SERVE = """
import importlib, socket, sys
import uvicorn
module, attribute = sys.argv[1].split(":")
app = getattr(importlib.import_module(module), attribute)
sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
sock.bind(("127.0.0.1", 0))
sock.listen(128)
print(sock.getsockname()[1], flush=True)
uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[sock])
"""


def read_port(process: subprocess.Popen, log, deadline: float) -> int:
    """The port the child printed, or RuntimeError with its output when it exits or is late."""
    ready, _, _ = select.select([process.stdout], [], [], max(deadline - time.monotonic(), 0))
    line = process.stdout.readline() if ready else ""
    if not line.strip().isdigit():
        process.kill()
        process.wait(timeout=STOP_DEADLINE_S)
        raise RuntimeError(
            f"the OpenEnv server printed no port within {START_DEADLINE_S} s ({line!r}): {errors(log)}"
        )
    return int(line)


def wait_healthy(url: str, process: subprocess.Popen, log, deadline: float) -> None:
    """Until GET {url}/health answers healthy; RuntimeError when the child exits or the deadline passes."""
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the OpenEnv server exited with {process.returncode}: {errors(log)}")
        with contextlib.suppress(OSError), urllib.request.urlopen(f"{url}/health", timeout=5) as response:
            if json.loads(response.read()).get("status") == "healthy":
                return
        time.sleep(0.05)  # a poll interval, not a wait for something to happen
    raise RuntimeError(f"the OpenEnv server at {url} did not answer /health within {START_DEADLINE_S} s")


def errors(log) -> str:
    """What the child wrote to its stderr `log` (a file, so that a chatty server never blocks on a pipe)."""
    log.seek(0)
    return log.read()[-4000:]


@contextlib.contextmanager
def openenv_server(app: str, env: dict[str, str] | None = None) -> Iterator[str]:
    """The base URL of a server of `app` ("module:attribute", importable from tests/agents), with
    `env` added to its environment variables."""
    child_env = {**os.environ, **(env or {})}
    child_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), child_env.get("PYTHONPATH")]))
    with tempfile.TemporaryFile(mode="w+") as stderr:
        process = subprocess.Popen(
            [sys.executable, "-c", SERVE, app],
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            env=child_env,
        )
        try:
            deadline = time.monotonic() + START_DEADLINE_S
            url = f"http://127.0.0.1:{read_port(process, stderr, deadline)}"
            wait_healthy(url, process, stderr, deadline)
            yield url
        finally:
            stop(process)


def stop(process: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL if it is still there after STOP_DEADLINE_S."""
    process.terminate()
    try:
        process.wait(timeout=STOP_DEADLINE_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=STOP_DEADLINE_S)
    process.stdout.close()
