"""Starting the run's own Ray node on this machine, again when its start timed out.

Ray waits a fixed 30 s for a new node's raylet to register with the GCS (ray/_private/node.py,
`raylet_start_wait_time_s`, no setting) and then raises a plain `Exception`, leaving the GCS and
raylet it started running. A machine busy with other work (two test workers' vLLM engines on two
cores) can miss that wait once; the next start usually makes it. Each failed start's processes
are stopped before the next, and after the last one the run stops with one line saying what
happened and where Ray's logs are.
"""

import os
from collections.abc import Callable

import psutil

NODE_START_TIMEOUT = "The current node timed out during startup"
START_ATTEMPTS = 3


class RayStartError(ConnectionError):
    """The local Ray node did not start (main.py prints it as one `error:` line)."""


def start_local_ray(num_cpus: int, **init_options) -> None:
    """ray.init for a fresh local node of `num_cpus` logical CPUs (and ray.init's `init_options`),
    at most START_ATTEMPTS starts."""
    import ray

    def start() -> None:
        ray.init(num_cpus=num_cpus, include_dashboard=False, configure_logging=False, **init_options)

    start_with_retries(start, START_ATTEMPTS)


def start_with_retries(start: Callable[[], None], attempts: int) -> None:
    """`start()` until it returns; a start that timed out has its new child processes stopped and
    is tried again, `attempts` times in all. Any other error stands."""
    for attempt in range(1, attempts + 1):
        before = {child.pid for child in psutil.Process().children(recursive=True)}
        try:
            start()
            return
        except Exception as err:  # Ray raises this one as a bare Exception
            if NODE_START_TIMEOUT not in str(err):
                raise
            stop_new_children(before)
            if attempt == attempts:
                raise RayStartError(
                    f"the local Ray node did not start in {attempts} attempts ({err}); the machine may be "
                    f"overloaded: Ray's logs are under {ray_session_logs()}"
                ) from err
            print(
                f"Ray's node start timed out (attempt {attempt} of {attempts}); starting it again",
                flush=True,
            )


def stop_new_children(before: set[int]) -> None:
    """Kills this process's children that are not in `before` (a failed start's GCS, raylet, ...)
    and waits for them to go."""
    new = [child for child in psutil.Process().children(recursive=True) if child.pid not in before]
    for child in new:
        try:
            child.kill()
        except psutil.NoSuchProcess:
            continue
    psutil.wait_procs(new)


def ray_session_logs() -> str:
    """Where the newest Ray session on this machine keeps its logs."""
    temp = os.environ.get("RAY_TMPDIR", "/tmp/ray")
    return os.path.join(temp, "session_latest", "logs")
