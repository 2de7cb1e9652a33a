"""Which device each worker trains on and which GPUs each SGLang engine sees (`engines.placement`).

The functions are plain; the Ray tests run them inside real Ray workers started with fake GPUs
(`ray.init(num_gpus=8)` works without GPUs: Ray still narrows CUDA_VISIBLE_DEVICES per worker),
which is the environment the GPU path sees. Those clusters live in a subprocess, as the session
cluster owns this process's Ray connection.
"""

import json
import os
import sys
from pathlib import Path

import pytest
from process_group import run_in_own_session

from engines.placement import (
    DeviceSlot,
    engine_devices,
    engine_devices_by_rank,
    training_device_index,
    visible_devices,
)

TESTS = Path(__file__).resolve().parent
ROLLOUT_TPS = [
    1,
    2,
    4,
    8,
]  # the rollout sizes of the (actor TP, rollout TP) pairs (1,1) (2,2) (4,2) (2,4) (8,8)


def test_visible_devices_and_training_device():
    assert visible_devices(None, 3) == ["0", "1", "2"]
    assert visible_devices("4, 6", 8) == ["4", "6"]
    with pytest.raises(ValueError, match="names a device twice"):
        visible_devices("1,1", 8)
    assert training_device_index(["5"], local_rank=5) == 0  # Ray narrowed: cuda:0 whatever LOCAL_RANK
    assert training_device_index(["0", "1", "2", "3"], local_rank=2) == 2  # torchrun: LOCAL_RANK
    with pytest.raises(RuntimeError, match="LOCAL_RANK=4 but this process sees 2 devices"):
        training_device_index(["0", "1"], local_rank=4)
    with pytest.raises(RuntimeError, match="no CUDA device is visible"):
        training_device_index([], local_rank=0)


def test_engine_devices_follow_group_order_and_refuse_bad_groups():
    slots = [DeviceSlot("a", d) for d in ("3", "1", "2", "0")]
    plans = engine_devices_by_rank(slots, rollout_tp=2)
    assert [None if p is None else (p.visible_devices, p.base_gpu_id) for p in plans] == [
        (("3", "1"), 0), None, (("2", "0"), 0), None,
    ]  # fmt: skip
    assert plans[0].cuda_visible_devices == "3,1"
    with pytest.raises(ValueError, match="spans nodes"):
        engine_devices([DeviceSlot("a", "0"), DeviceSlot("b", "0")])
    with pytest.raises(ValueError, match="share GPUs"):
        engine_devices([DeviceSlot("a", "0"), DeviceSlot("a", "0")])
    with pytest.raises(ValueError, match="not a multiple"):
        engine_devices_by_rank(slots[:3], rollout_tp=2)


SCRIPT = """
import json, sys, ray
from ray.cluster_utils import Cluster
from single_controller_workers import PlacementProbe
from hybridflow.single_controller import (
    RayClassWithInitArgs, RayResourcePool, RayWorkerGroup, create_colocated_worker_cls,
)

nodes, gpus_per_node, rollout_tps = json.loads(sys.argv[1])
cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
for _ in range(nodes):
    cluster.add_node(num_cpus=gpus_per_node, num_gpus=gpus_per_node)
ray.init(address=cluster.address)
cluster.wait_for_nodes()
pool = RayResourcePool([gpus_per_node] * nodes, use_gpu=True, name_prefix="placement")
fused = create_colocated_worker_cls({
    "actor_rollout": RayClassWithInitArgs(PlacementProbe, "actor_rollout"),
    "critic": RayClassWithInitArgs(PlacementProbe, "critic"),
})
group = RayWorkerGroup(pool, fused)
views = group.spawn(prefix_set={"actor_rollout", "critic"})
report = {"actor": views["actor_rollout"].placement(rollout_tps), "critic": views["critic"].placement([])}
group.shutdown()
pool.release()
ray.shutdown()
cluster.shutdown()
print("REPORT" + json.dumps(report))
"""


def run_cluster(nodes: int, gpus_per_node: int, rollout_tps: list[int]) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS.parent), str(TESTS)]), OMP_NUM_THREADS="1")
    args = json.dumps([nodes, gpus_per_node, rollout_tps])
    done = run_in_own_session(
        [sys.executable, "-c", SCRIPT, args],
        env=env,
        timeout=900,
        cwd=TESTS.parent,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("REPORT")]
    assert done.returncode == 0 and lines, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(lines[0].removeprefix("REPORT"))


def check_ranks(report: dict) -> list[dict]:
    """Every rank trains on a device it sees, the one Ray gave it; colocated roles share it."""
    actor, critic = report["actor"], report["critic"]
    for rank, (mine, colocated) in enumerate(zip(actor, critic, strict=True)):
        assert mine["visible"] == mine["ray_gpu_ids"] and len(mine["visible"]) == 1, (rank, mine)
        assert 0 <= mine["training_index"] < len(mine["visible"])
        assert mine["slot"] == mine["visible"][mine["training_index"]]
        assert (colocated["pid"], colocated["slot"]) == (mine["pid"], mine["slot"]), rank
    slots = [(r["node"], r["slot"]) for r in actor]
    assert len(set(slots)) == len(slots), slots  # one GPU per rank
    return actor


@pytest.mark.slow
def test_one_node_with_eight_fake_gpus():
    actor = check_ranks(run_cluster(nodes=1, gpus_per_node=8, rollout_tps=ROLLOUT_TPS))
    for rollout_tp in ROLLOUT_TPS:
        for rank, report in enumerate(actor):
            plan = report["engines"][str(rollout_tp)]
            if rank % rollout_tp:
                assert plan is None, (rollout_tp, rank, plan)
                continue
            group = actor[rank : rank + rollout_tp]
            # The engine sees exactly its group's GPUs, scheduler i on member i's.
            assert plan == [[member["slot"] for member in group], 0], (rollout_tp, rank, plan)


@pytest.mark.slow
def test_two_nodes_keep_engines_within_a_node():
    actor = check_ranks(run_cluster(nodes=2, gpus_per_node=2, rollout_tps=[2, 4]))
    nodes = [r["node"] for r in actor]
    assert nodes[0] == nodes[1] != nodes[2] == nodes[3]  # laid out node by node
    assert [r["engines"]["2"] for r in actor] == [
        [[actor[0]["slot"], actor[1]["slot"]], 0], None, [[actor[2]["slot"], actor[3]["slot"]], 0], None,
    ]  # fmt: skip
    assert all("spans nodes" in r["engines"]["4"] for r in actor)  # every rank learns it, none hangs
