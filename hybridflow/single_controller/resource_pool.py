"""Where worker processes go: `RayResourcePool` (placement groups) and `ResourcePoolManager`.

A pool is a list of per-node process counts, e.g. `[4, 4]`: 4 slots on each of two nodes. Each
entry becomes one STRICT_PACK placement group (all its slots on one node), and entries are kept
on different nodes. A slot is one bundle of `{"CPU": max_colocate_count}` (+ 1 GPU with
`use_gpu`), so up to `max_colocate_count` processes of different worker groups can share it.
Demands the cluster can never place are a ValueError before anything is created; placement
that does not happen within `placement_timeout_s` (resources held by others) is a TimeoutError.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group

NODE_ID_LABEL = "ray.io/node-id"


class RayResourcePool:
    """Slots for worker processes, laid out node by node (rank order follows `process_on_nodes`).

    Args:
        process_on_nodes: processes per node, one entry per node, e.g. `[8]` or `[4, 4]`.
        use_gpu: each slot also holds one GPU.
        max_colocate_count: how many separate worker-group processes may share a slot (each takes
            1 CPU and 1/max_colocate_count GPU). Colocating roles in one process
            (`create_colocated_worker_cls`) needs only 1.
        name_prefix: names the placement groups (`<prefix>_node<i>`), for `ray status` and errors.
        placement_timeout_s: how long to wait for each node's placement group.

    Placement groups are created on first use (`placement_groups()`), so building a pool needs no
    running Ray; `release()` removes them.
    """

    def __init__(
        self,
        process_on_nodes: list[int],
        use_gpu: bool = False,
        max_colocate_count: int = 1,
        name_prefix: str = "hybridflow_pool",
        placement_timeout_s: float = 60.0,
    ):
        if not isinstance(process_on_nodes, list | tuple) or not process_on_nodes:
            raise ValueError(f"process_on_nodes must be a non-empty list of ints, got {process_on_nodes!r}")
        if not all(isinstance(n, int) and n >= 1 for n in process_on_nodes):
            raise ValueError(f"process_on_nodes entries must be positive ints, got {process_on_nodes!r}")
        if not (isinstance(max_colocate_count, int) and max_colocate_count >= 1):
            raise ValueError(f"max_colocate_count must be a positive int, got {max_colocate_count!r}")
        self.process_on_nodes = list(process_on_nodes)
        self.use_gpu = bool(use_gpu)
        self.max_colocate_count = max_colocate_count
        self.name_prefix = name_prefix
        self.placement_timeout_s = placement_timeout_s
        self._placement_groups: list[PlacementGroup] | None = None

    @property
    def world_size(self) -> int:
        return sum(self.process_on_nodes)

    @property
    def bundle(self) -> dict[str, float]:
        """Resources of one slot."""
        return {"CPU": float(self.max_colocate_count), **({"GPU": 1.0} if self.use_gpu else {})}

    def actor_resources(self) -> dict[str, float]:
        """`num_cpus` / `num_gpus` options for one worker process in a slot."""
        return {"num_cpus": 1, **({"num_gpus": 1.0 / self.max_colocate_count} if self.use_gpu else {})}

    def placement_groups(self) -> list[PlacementGroup]:
        """One ready placement group per node entry (created on the first call)."""
        if self._placement_groups is None:
            check_pools_fit({self.name_prefix: self})
            self._placement_groups = self._create_placement_groups()
        return self._placement_groups

    def slot_nodes(self) -> list[str]:
        """Node id of every slot, in rank order."""
        table = ray.util.placement_group_table
        return [
            table(pg)["bundles_to_node_id"][bundle]
            for pg, count in zip(self.placement_groups(), self.process_on_nodes, strict=True)
            for bundle in range(count)
        ]

    def release(self) -> None:
        """Remove the placement groups (kill the worker groups using them first)."""
        for pg in self._placement_groups or []:
            remove_placement_group(pg)
        self._placement_groups = None

    def _create_placement_groups(self) -> list[PlacementGroup]:
        created: list[PlacementGroup] = []
        used_nodes: list[str] = []
        try:
            for index, count in enumerate(self.process_on_nodes):
                # Keep every entry on its own node: exclude the nodes earlier entries landed on.
                selector = [{NODE_ID_LABEL: f"!in({','.join(used_nodes)})"}] * count if used_nodes else None
                pg = placement_group(
                    [self.bundle] * count,
                    strategy="STRICT_PACK",
                    name=f"{self.name_prefix}_node{index}",
                    bundle_label_selector=selector,
                )
                created.append(pg)
                self._wait_ready(pg, index, count)
                used_nodes.append(ray.util.placement_group_table(pg)["bundles_to_node_id"][0])
        except BaseException:
            for pg in created:
                remove_placement_group(pg)
            raise
        return created

    def _wait_ready(self, pg: PlacementGroup, index: int, count: int) -> None:
        try:
            ray.get(pg.ready(), timeout=self.placement_timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(
                f"resource pool {self.name_prefix!r}: node entry {index} ({count} slots of {self.bundle}) "
                f"was not placed within {self.placement_timeout_s:.0f}s; the cluster has these resources "
                f"available now: {ray.available_resources()} (other worker groups or placement groups may "
                "hold the rest)"
            ) from None


def check_pools_fit(pools: dict[str, RayResourcePool]) -> None:
    """ValueError naming what is missing when the cluster can never host `pools` together.

    Each pool's node entries need distinct nodes with room for their slots; all pools together
    need no more CPUs/GPUs than the cluster has (pools may share nodes).
    """
    nodes = _alive_node_capacities()
    for name, pool in pools.items():
        _check_pool_fits_nodes(name, pool, nodes)
    totals = {"CPU": 0.0, "GPU": 0.0}
    for pool in pools.values():
        for key, amount in pool.bundle.items():
            totals[key] += amount * pool.world_size
    for key, needed in totals.items():
        have = sum(node.get(key, 0.0) for node in nodes)
        if needed > have:
            demand = ", ".join(f"{n!r}: {p.world_size} slots of {p.bundle}" for n, p in pools.items())
            raise ValueError(
                f"resource pools need {needed:g} {key} in all ({demand}); the cluster has {have:g} {key}"
            )


def _check_pool_fits_nodes(name: str, pool: RayResourcePool, nodes: list[dict[str, float]]) -> None:
    free = [dict(node) for node in nodes]
    for count in sorted(pool.process_on_nodes, reverse=True):
        need = {key: amount * count for key, amount in pool.bundle.items()}
        fitting = [node for node in free if all(node.get(k, 0.0) >= v for k, v in need.items())]
        if not fitting:
            raise ValueError(
                f"resource pool {name!r} needs {len(pool.process_on_nodes)} distinct nodes hosting "
                f"{pool.process_on_nodes} slots of {pool.bundle}; the cluster's {len(nodes)} node(s) have "
                f"{[{k: v for k, v in n.items() if k in ('CPU', 'GPU')} for n in nodes]} in total"
            )
        free.remove(max(fitting, key=lambda node: node.get("CPU", 0.0)))


def _alive_node_capacities() -> list[dict[str, float]]:
    if not ray.is_initialized():
        raise RuntimeError("resource pools need a running Ray: call ray.init() (or join a cluster) first")
    return [node["Resources"] for node in ray.nodes() if node["Alive"]]


class Role(Enum):
    """The worker roles a trainer maps to resource pools."""

    ActorRollout = "actor_rollout"
    ActorRolloutRef = "actor_rollout_ref"
    Critic = "critic"
    RefPolicy = "ref"
    RewardModel = "reward_model"


@dataclass
class ResourcePoolManager:
    """Named resource pools and which pool each role runs in.

    Args:
        resource_pool_spec: pool name -> processes per node, e.g. `{"global_pool": [4, 4]}`.
        mapping: role -> pool name, e.g. `{Role.ActorRollout: "global_pool", Role.Critic: "global_pool"}`.
        use_gpu: slots hold a GPU each; None (default) means "if the cluster has GPUs".
        max_colocate_count: see `RayResourcePool`.
    """

    resource_pool_spec: dict[str, list[int]]
    mapping: dict[Role, str]
    use_gpu: bool | None = None
    max_colocate_count: int = 1
    resource_pool_dict: dict[str, RayResourcePool] = field(default_factory=dict, init=False)

    def __post_init__(self):
        for role, pool_name in self.mapping.items():
            if not isinstance(role, Role):
                raise TypeError(f"ResourcePoolManager.mapping keys must be Role members, got {role!r}")
            if pool_name not in self.resource_pool_spec:
                raise ValueError(
                    f"role {role.name} is mapped to pool {pool_name!r}, which is not in resource_pool_spec "
                    f"(pools: {sorted(self.resource_pool_spec)})"
                )

    def create_resource_pool(self) -> None:
        """Build every pool after checking the cluster can host them (placement groups come on first use)."""
        pools = self._build_pools()
        check_pools_fit(pools)
        self.resource_pool_dict = pools

    def get_resource_pool(self, role: Role) -> RayResourcePool:
        if role not in self.mapping:
            raise KeyError(
                f"role {role} has no resource pool; mapped roles: {[r.name for r in self.mapping]}"
            )
        if not self.resource_pool_dict:
            raise RuntimeError("call ResourcePoolManager.create_resource_pool() before get_resource_pool()")
        return self.resource_pool_dict[self.mapping[role]]

    def get_n_procs(self) -> int:
        """Processes over all pools."""
        return sum(sum(nodes) for nodes in self.resource_pool_spec.values())

    def check_resources_available(self) -> None:
        """ValueError naming the missing resources when the cluster cannot host every pool."""
        check_pools_fit(self._build_pools())

    def _build_pools(self) -> dict[str, RayResourcePool]:
        use_gpu = self.use_gpu if self.use_gpu is not None else ray.cluster_resources().get("GPU", 0) > 0
        return {
            name: RayResourcePool(
                nodes, use_gpu=use_gpu, max_colocate_count=self.max_colocate_count, name_prefix=name
            )
            for name, nodes in self.resource_pool_spec.items()
        }
