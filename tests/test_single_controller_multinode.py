"""A resource pool spanning two nodes, simulated on one machine with `ray.cluster_utils.Cluster`.

The session fixture owns this process's Ray connection, so the cluster lives in a subprocess
that prints what the workers saw as JSON; the assertions are here.
"""

import json
import os
import sys
from pathlib import Path

import pytest
from process_group import run_in_own_session

TESTS = Path(__file__).resolve().parent

SCRIPT = """
import json, ray
from ray.cluster_utils import Cluster
from single_controller_workers import ProbeWorker
from hybridflow.single_controller import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup

cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
nodes = [cluster.add_node(num_cpus=4), cluster.add_node(num_cpus=4)]  # [2, 2] could share one
ray.init(address=cluster.address)
cluster.wait_for_nodes()
report = {"node_addresses": {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}}
try:
    RayResourcePool([5], name_prefix="no_node_fits").placement_groups()
except ValueError as err:
    report["five_on_one_node"] = str(err)
pool = RayResourcePool([2, 2], name_prefix="two_nodes")
group = RayWorkerGroup(pool, RayClassWithInitArgs(ProbeWorker, "multinode"))
report["envs"] = group.env()
report["all_reduce"] = group.all_reduce_rank_plus_one()
group.shutdown()
pool.release()
ray.shutdown()
cluster.shutdown()
print("REPORT" + json.dumps(report))
"""


@pytest.fixture(scope="module")
def report():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS.parent), str(TESTS)]), OMP_NUM_THREADS="1")
    done = run_in_own_session([sys.executable, "-c", SCRIPT], env=env, timeout=600, cwd=TESTS.parent)
    lines = [line for line in done.stdout.splitlines() if line.startswith("REPORT")]
    assert done.returncode == 0 and lines, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(lines[0].removeprefix("REPORT"))


def test_ranks_are_laid_out_node_by_node_on_distinct_nodes(report):
    # Either node could hold both entries; the pool keeps its entries on distinct nodes.
    envs = report["envs"]
    assert [e["RANK"] for e in envs] == ["0", "1", "2", "3"]
    assert {e["WORLD_SIZE"] for e in envs} == {"4"}
    nodes = [e["node_id"] for e in envs]
    assert nodes[0] == nodes[1] and nodes[2] == nodes[3] and nodes[0] != nodes[2]
    assert [e["LOCAL_RANK"] for e in envs] == ["0", "1", "0", "1"]
    assert {e["LOCAL_WORLD_SIZE"] for e in envs} == {"2"}


def test_master_addr_is_rank_zero_node_and_gloo_works_across_nodes(report):
    envs = report["envs"]
    assert {e["MASTER_ADDR"] for e in envs} == {report["node_addresses"][envs[0]["node_id"]]}
    assert len({e["MASTER_PORT"] for e in envs}) == 1
    assert report["all_reduce"] == [10.0] * 4  # 1 + 2 + 3 + 4 over both nodes


def test_slots_of_one_node_entry_must_fit_on_one_node(report):
    # 8 CPUs in the cluster, but no single node has 5.
    assert "needs 1 distinct nodes hosting [5] slots" in report["five_on_one_node"]
