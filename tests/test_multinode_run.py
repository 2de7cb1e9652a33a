"""The tiny recipe on two Ray nodes (simulated on this machine with `ray.cluster_utils.Cluster`),
joined through RAY_ADDRESS the way a user runs against an existing cluster: trainer.nnodes=2, one
worker process per node, so the resource pool and Megatron's gloo groups span both nodes.

The session fixture owns this process's Ray connection, so the cluster lives in a subprocess that
prints a JSON report; the assertions are here.
"""

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
from multinode_helpers import TOTAL_STEPS, write_tiny_recipe
from process_group import run_in_own_session

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow

# Each of the two nodes (the head and one more) has exactly one CPU, so the two worker processes
# (one CPU each) can only run on different nodes.
SCRIPT = """
import json, os, subprocess, sys
import ray
from ray.cluster_utils import Cluster
from hybridflow.launch.cluster import check_cluster_resources

recipe, root = sys.argv[1], sys.argv[2]
cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
cluster.add_node(num_cpus=1)
cluster.wait_for_nodes()
ray.init(address=cluster.address, log_to_driver=False)
report = {"node_ids": [node.node_id for node in cluster.list_all_nodes()]}
check_cluster_resources(2, 1, use_gpu=False)
try:
    check_cluster_resources(3, 1, use_gpu=False)
except ValueError as err:
    report["three_nodes_error"] = str(err)
run = subprocess.run(
    ["bash", os.path.join(root, "scripts", "run_recipe.sh"), recipe,
     "trainer.nnodes=2", "trainer.n_gpus_per_node=1", "trainer.use_gpu=false"],
    env=dict(os.environ, RAY_ADDRESS=cluster.address), capture_output=True, text=True, timeout=600,
)
report["returncode"], report["output_tail"] = run.returncode, (run.stdout + run.stderr)[-4000:]
report["worker_actor_nodes"] = sorted(
    actor["Address"]["NodeID"]
    for actor in ray._private.state.actors().values()
    if actor["ActorClassName"].endswith("HybridPolicyWorker")
)
ray.shutdown()
cluster.shutdown()
print("REPORT" + json.dumps(report))
"""


@pytest.fixture(scope="module")
def two_node_run(tmp_path_factory):
    work = tmp_path_factory.mktemp("multinode")
    recipe = write_tiny_recipe(work, work / "run")
    # Ray's own directory for this cluster, so it never advertises itself to other runs on the
    # machine (ray.init(address="auto") reads <RAY_TMPDIR>/ray/ray_current_cluster); short, for
    # Ray's socket paths.
    ray_tmp = tempfile.mkdtemp(prefix="hfm", dir="/tmp")
    env = dict(
        os.environ,
        PYTHONPATH=str(ROOT),
        RAY_TMPDIR=ray_tmp,
        RAY_AUTH_MODE="disabled",  # one machine, one user: no token to share between processes
        OMP_NUM_THREADS="1",
    )
    env.pop("RAY_ADDRESS", None)
    try:
        done = run_in_own_session(
            [sys.executable, "-c", SCRIPT, str(recipe), str(ROOT)],
            env=env,
            timeout=800,
            cwd=work,
        )
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("REPORT")]
    assert done.returncode == 0 and lines, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(lines[0].removeprefix("REPORT")), work / "run"


def test_recipe_runs_with_a_pool_spanning_two_nodes(two_node_run):
    report, run_dir = two_node_run
    assert report["returncode"] == 0, report["output_tail"]
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, TOTAL_STEPS + 1))
    assert all("actor/pg_loss" in m for m in metrics)
    # One worker process on each of the two nodes.
    assert report["worker_actor_nodes"] == sorted(report["node_ids"])


def test_cluster_check_names_the_missing_node(two_node_run):
    report, _ = two_node_run
    message = report["three_nodes_error"]
    assert "trainer.nnodes=3" in message
    assert "2 of the 2 alive node(s) have that, so 1 more are missing" in message
