"""hybridflow/launch/local_ray.py: a local Ray node whose start timed out (Ray's fixed 30 s wait for
its raylet, missed on a busy machine) is stopped and started again; the last failure is one error.

The starts here are stand-ins for ray.init that spawn a child process and raise Ray's own message
(ray/_private/node.py); the retry over a real ray.init was checked by hand (get_node held back 40 s).
"""

import subprocess
import sys

import psutil
import pytest

from hybridflow.launch.local_ray import NODE_START_TIMEOUT, RayStartError, start_with_retries

RAY_TIMEOUT = Exception(
    f"{NODE_START_TIMEOUT}. This could happen because some of the raylet failed to startup or the GCS "
    "has become overloaded."
)


class Starts:
    """A start that spawns a child (the failed node's GCS) and times out `failures` times."""

    def __init__(self, failures: int, error: Exception = RAY_TIMEOUT):
        self.failures, self.error, self.children = failures, error, []

    def __call__(self) -> None:
        self.children.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"]))
        if len(self.children) <= self.failures:
            raise self.error


def test_a_timed_out_start_is_stopped_and_started_again(capsys):
    start = Starts(failures=2)
    try:
        start_with_retries(start, attempts=3)
        assert len(start.children) == 3
        assert [child.poll() is not None for child in start.children] == [True, True, False]
        assert capsys.readouterr().out.splitlines() == [
            "Ray's node start timed out (attempt 1 of 3); starting it again",
            "Ray's node start timed out (attempt 2 of 3); starting it again",
        ]
    finally:
        start.children[-1].kill()
        start.children[-1].wait()


def test_the_last_timed_out_start_is_one_error_and_leaves_nothing_running():
    start = Starts(failures=3)
    with pytest.raises(RayStartError, match=r"did not start in 3 attempts .*Ray's logs are under \S+") as err:
        start_with_retries(start, attempts=3)
    assert err.value.__cause__ is RAY_TIMEOUT
    assert all(child.poll() is not None for child in start.children)
    assert {child.pid for child in start.children}.isdisjoint(p.pid for p in psutil.Process().children())


def test_any_other_start_error_stands_at_once():
    start = Starts(failures=1, error=ValueError("When connecting to an existing cluster, num_cpus ..."))
    try:
        with pytest.raises(ValueError, match="existing cluster"):
            start_with_retries(start, attempts=3)
        assert len(start.children) == 1
    finally:
        start.children[0].kill()
        start.children[0].wait()
