"""Checks that a Ray cluster can run a recipe: the nodes a Slurm job started have joined, and the
cluster holds the nodes and devices the recipe asks for. Both fail fast with an error naming what
is missing, before any worker starts.

    python hybridflow/launch/cluster.py wait-nodes --address 10.0.0.1:6379 --nodes n1=PID1,n2=PID2

`wait-nodes` is what scripts/slurm/run_recipe.sbatch runs on the head (by path: it imports only
the standard library and Ray, not the hybridflow package and its torch); the trainer calls
`check_cluster_resources` at start. The pure functions take Ray's node table (`ray.nodes()`) as
input so they are testable without a cluster.
"""

import argparse
import os
import sys
import time
from collections.abc import Sequence

# Node label the Slurm launch gives every Ray node (`ray start --labels slurm-node=<name>`).
SLURM_NODE_LABEL = "slurm-node"


def node_requirement(devices_per_node: int, use_gpu: bool, cpus_per_device: float = 1.0) -> dict[str, float]:
    """Ray resources one node of the run needs: a CPU per worker process, plus a GPU each with use_gpu
    (the resource pool's slot is `{"CPU": 1, "GPU": 1}`, or `{"CPU": 1}` on CPU)."""
    need = {"CPU": devices_per_node * cpus_per_device}
    if use_gpu:
        need["GPU"] = float(devices_per_node)
    return need


def describe_node(node: dict) -> str:
    """`10.0.0.1 (host1): 8 GPU, 64 CPU` from one `ray.nodes()` entry."""
    resources = node.get("Resources", {})
    counts = ", ".join(f"{resources.get(key, 0):g} {key}" for key in ("GPU", "CPU"))
    return f"{node.get('NodeManagerAddress', '?')} ({node.get('NodeManagerHostname', '?')}): {counts}"


def shortfall(node: dict, need: dict[str, float]) -> dict[str, float]:
    """What `node` lacks to meet `need` (empty when it fits)."""
    resources = node.get("Resources", {})
    return {
        key: amount - resources.get(key, 0.0)
        for key, amount in need.items()
        if resources.get(key, 0.0) < amount
    }


def check_cluster_resources(
    nnodes: int,
    devices_per_node: int,
    use_gpu: bool,
    nodes: Sequence[dict] | None = None,
    cpus_per_device: float = 1.0,
    rollout_pool: tuple[int, int] | None = None,
) -> None:
    """Raise ValueError naming what is missing unless `nnodes` distinct alive nodes each have
    `devices_per_node` GPUs (with `use_gpu`) and a CPU per worker process. The resource pool keeps
    each node's ranks on one node and different nodes apart, so this is exactly what it can place.
    `devices_per_node` is the sum over the pools on every node (trainer.n_gpus_per_node).
    `rollout_pool` (trainer.rollout_pool's nnodes, n_gpus_per_node; disaggregated placement) must
    then fit in what the trainer's nodes leave and the other nodes have.
    `nodes` is a `ray.nodes()` table; None queries the Ray cluster this process is connected to."""
    for key, value in (("trainer.nnodes", nnodes), ("trainer.n_gpus_per_node", devices_per_node)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{key} must be a positive integer, got {value!r}")
    if nodes is None:
        nodes = _connected_cluster_nodes()
    alive = [node for node in nodes if node.get("Alive", False)]
    need = node_requirement(devices_per_node, use_gpu, cpus_per_device)
    fitting = [node for node in alive if not shortfall(node, need)]
    if len(fitting) < nnodes:
        raise ValueError(trainer_shortfall(nnodes, devices_per_node, use_gpu, alive, need))
    if rollout_pool is not None:
        placed = f"trainer.nnodes={nnodes} x trainer.n_gpus_per_node={devices_per_node}"
        pool_need = node_requirement(rollout_pool[1], use_gpu, cpus_per_device)
        check_rollout_pool(rollout_pool, after_placing(alive, nnodes, need), pool_need, placed)


def trainer_shortfall(nnodes: int, devices: int, use_gpu: bool, alive: list[dict], need: dict) -> str:
    """What the nodes lack for the trainer's processes (the trainer.* keys, the fix)."""
    fitting = [node for node in alive if not shortfall(node, need)]
    lacking = [
        f"{describe_node(node)} lacks " + ", ".join(f"{v:g} {k}" for k, v in shortfall(node, need).items())
        for node in alive
        if shortfall(node, need)
    ]
    wanted = ", ".join(f"{v:g} {k}" for k, v in need.items())
    return (
        f"the Ray cluster cannot run this recipe: trainer.nnodes={nnodes}, "
        f"trainer.n_gpus_per_node={devices}, trainer.use_gpu={str(use_gpu).lower()} need "
        f"{nnodes} node(s) with {wanted} each; {len(fitting)} of the {len(alive)} alive node(s) have "
        f"that, so {nnodes - len(fitting)} more are missing. "
        + (f"Too small: {'; '.join(lacking)}. " if lacking else "")
        + "Add nodes, or lower trainer.nnodes / trainer.n_gpus_per_node."
    )


def after_placing(nodes: Sequence[dict], count: int, need: dict[str, float]) -> list[dict]:
    """`nodes` with `need` taken from `count` of them, each time the fitting node with the least
    room (best fit: the big nodes stay free for the next pool)."""
    left = [{**node, "Resources": dict(node.get("Resources", {}))} for node in nodes]
    for _ in range(count):
        fitting = [node for node in left if not shortfall(node, need)]
        chosen = min(fitting, key=lambda node: [node["Resources"].get(key, 0.0) for key in ("GPU", "CPU")])
        for key, amount in need.items():
            chosen["Resources"][key] -= amount
        left.remove(chosen)
        left.append(chosen)  # a pool's node entries go to distinct nodes: it is not chosen again
    return left


def check_rollout_pool(pool: tuple[int, int], left: list[dict], need: dict[str, float], placed: str) -> None:
    """ValueError naming trainer.rollout_pool.* unless `pool[0]` of the `left` nodes (what is left
    once the `placed` processes are) meet `need`."""
    fitting = [node for node in left if not shortfall(node, need)]
    if len(fitting) >= pool[0]:
        return
    wanted = ", ".join(f"{v:g} {k}" for k, v in need.items())
    room = "; ".join(
        f"{describe_node(node).split(': ')[0]}: "
        + ", ".join(f"{node['Resources'].get(k, 0):g} {k}" for k in ("GPU", "CPU"))
        + " left"
        for node in left
    )
    raise ValueError(
        f"the Ray cluster cannot place the rollout pool beside the trainer: trainer.rollout_pool.nnodes="
        f"{pool[0]}, trainer.rollout_pool.n_gpus_per_node={pool[1]} need {pool[0]} node(s) with {wanted} "
        f"each, but once {placed} are placed, {len(fitting)} of the {len(left)} alive "
        f"node(s) have that ({room}). Add nodes, or lower trainer.rollout_pool.n_gpus_per_node / "
        "trainer.rollout_pool.nnodes (or trainer.n_gpus_per_node)."
    )


def _connected_cluster_nodes() -> list[dict]:
    import ray

    if not ray.is_initialized():
        raise RuntimeError("check_cluster_resources(nodes=None) needs ray.init() to have connected first")
    return ray.nodes()


def missing_slurm_nodes(expected: Sequence[str], nodes: Sequence[dict]) -> list[str]:
    """The expected Slurm node names with no alive Ray node labelled with them."""
    joined = {node.get("Labels", {}).get(SLURM_NODE_LABEL) for node in nodes if node.get("Alive", False)}
    return [name for name in expected if name not in joined]


def wait_for_slurm_nodes(
    address: str, launchers: dict[str, int | None], timeout_s: float, poll_s: float = 1.0
) -> None:
    """Block until every Slurm node in `launchers` has an alive Ray node. `launchers` maps each node
    to the local pid of the `srun` that starts Ray there (None: not watched); a node whose launcher
    exits before it joined is a RuntimeError at once, a node still missing after `timeout_s` a
    TimeoutError, both naming the nodes."""
    import ray

    ray.init(address=address, log_to_driver=False, logging_level="warning")
    try:
        deadline = time.monotonic() + timeout_s
        while missing := missing_slurm_nodes(list(launchers), ray.nodes()):
            exited = [name for name in missing if launchers[name] and not _process_alive(launchers[name])]
            if exited:
                raise RuntimeError(
                    f"Ray exited before joining the cluster at {address} on: {', '.join(exited)}"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{len(missing)} of {len(launchers)} Slurm node(s) did not join the Ray cluster at "
                    f"{address} within {timeout_s:g} s: {', '.join(missing)}"
                )
            time.sleep(poll_s)
    finally:
        ray.shutdown()


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by someone else
        return True
    return True


def parse_launchers(spec: str) -> dict[str, int | None]:
    """`n1=123,n2=456,n3` -> {"n1": 123, "n2": 456, "n3": None}."""
    launchers: dict[str, int | None] = {}
    for item in filter(None, spec.split(",")):
        name, _, pid = item.partition("=")
        if pid and not pid.isdigit():
            raise ValueError(f"--nodes entry {item!r}: expected NAME or NAME=PID")
        launchers[name] = int(pid) if pid else None
    if not launchers:
        raise ValueError("--nodes is empty: expected NAME[=PID],...")
    return launchers


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    wait = commands.add_parser("wait-nodes", help="wait until the given Slurm nodes joined the Ray cluster")
    wait.add_argument("--address", required=True, help="Ray GCS address host:port")
    wait.add_argument(
        "--nodes", required=True, help="NAME[=PID],...: Slurm node names, each with the pid of its srun"
    )
    wait.add_argument("--timeout", type=float, default=180.0, help="seconds to wait (default 180)")
    args = parser.parse_args(argv)
    try:
        launchers = parse_launchers(args.nodes)
        wait_for_slurm_nodes(args.address, launchers, args.timeout)
    except (ValueError, RuntimeError, TimeoutError, ConnectionError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"all {len(launchers)} node(s) joined the Ray cluster at {args.address}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
