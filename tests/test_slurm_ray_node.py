"""scripts/slurm/ray_node.sh outside Slurm: a head and a worker "node" (two raylets on this
machine, with the environment srun would give them) form one cluster over IPv6, the join wait
sees both by their Slurm node label, and SIGTERM to each ray_node.sh stops everything: when the
script exits, no process of its node is left (it waits for its Ray process group, killing what
outlives the grace period, e.g. the dashboard and runtime-env agents)."""

import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from multinode_helpers import assert_nothing_left

from hybridflow.launch.node_address import source_address_toward

ROOT = Path(__file__).resolve().parents[1]
RAY_NODE = ROOT / "scripts" / "slurm" / "ray_node.sh"
CLUSTER_SCRIPT = ROOT / "hybridflow" / "launch" / "cluster.py"
pytestmark = pytest.mark.slow


def ipv6_address() -> str:
    """This machine's IPv6 address toward the outside, else loopback; skip without IPv6."""
    for target in ("2001:db8::1", "::1"):
        try:
            address = source_address_toward(target)
            with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as probe:
                probe.bind((address, 0))
            return address
        except OSError:
            continue
    pytest.skip("no usable IPv6 address on this machine")


def wait_for_head_port(host: str, temp_dir: str, head: subprocess.Popen, timeout_s: float = 120) -> int:
    """The port the head's GCS bound (port 0: `ray start` writes its address to the temp dir), once
    it accepts connections."""
    address_file = Path(temp_dir) / "ray_current_cluster"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert head.poll() is None, "the Ray head exited"
        try:
            port = int(address_file.read_text().rsplit(":", 1)[1])
            socket.create_connection((host, port), timeout=1).close()
            return port
        except (OSError, IndexError, ValueError):
            time.sleep(0.5)
    raise AssertionError(f"the Ray head did not write {address_file} and open its port in {timeout_s} s")


def test_head_and_worker_join_over_ipv6_and_stop_on_sigterm(tmp_path):
    head_ip = ipv6_address()
    port = 0  # the head's GCS binds one itself
    temp_dir = tempfile.mkdtemp(prefix="hfn", dir="/tmp")  # short: Ray's socket paths live under it
    token = "c" * 63 + "3"
    base_env = dict(
        os.environ,
        HYBRIDFLOW_PYTHON=sys.executable,
        HYBRIDFLOW_RAY=str(Path(sys.executable).parent / "ray"),
        HYBRIDFLOW_RAY_STOP_GRACE_S="5",
        RAY_AUTH_MODE="token",
        RAY_AUTH_TOKEN=token,
        SLURM_CPUS_ON_NODE="1",
    )
    nodes = {}
    try:
        for role, name in (("head", "fake-head"), ("worker", "fake-worker")):
            log = (tmp_path / f"{name}.log").open("w")
            nodes[name] = subprocess.Popen(
                ["bash", str(RAY_NODE), role, head_ip, str(port), temp_dir],
                env={**base_env, "SLURMD_NODENAME": name},
                stdout=log,
                stderr=subprocess.STDOUT,
            )
            if role == "head":
                port = wait_for_head_port(head_ip, temp_dir, nodes[name])
        launchers = ",".join(f"{name}={proc.pid}" for name, proc in nodes.items())
        address = f"[{head_ip}]:{port}"
        wait = ["wait-nodes", "--address", address, "--nodes", launchers, "--timeout", "120"]
        joined = subprocess.run(
            [sys.executable, str(CLUSTER_SCRIPT), *wait],
            env=base_env,
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert joined.returncode == 0, joined.stderr[-3000:]
        assert f"all 2 node(s) joined the Ray cluster at {address}" in joined.stdout
        worker_log = (tmp_path / "fake-worker.log").read_text()
        # The worker advertises the address of its interface toward the head: the same one here.
        assert f"[ray_node] worker on fake-worker at {head_ip}: 1 CPU, 0 GPU" in worker_log
    finally:
        for proc in nodes.values():
            proc.terminate()
        for proc in nodes.values():
            proc.wait(timeout=600)  # generous: the script's own bound is its grace period
        subprocess.run(["rm", "-rf", temp_dir], check=False)
    assert_nothing_left(token, timeout_s=0)  # the scripts returned only once their nodes were gone
    assert [proc.returncode for proc in nodes.values()] == [143, 143]  # stopped by the SIGTERM
