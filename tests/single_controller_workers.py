"""Worker classes shared by the single-controller tests (Ray and local backends).

Each method reports what its rank received and computed, so tests can check routing: which rank
got which chunk and whose outputs the driver collected. Ray workers cannot import `tests/`
modules, so this module's classes travel by value (cloudpickle) instead of by import.
"""

import datetime
import os
import sys
import threading
import time
from pathlib import Path

import ray
import torch

from hybridflow.protocol import DataProto
from hybridflow.single_controller import Dispatch, ParallelRanks, Worker, register


def megatron_order(rank: int, dp_size: int, tp_size: int, pp_size: int) -> dict[str, int]:
    """(dp, tp, pp) of a global rank in Megatron's order: tp fastest, then (cp=1) dp, then pp."""
    return {"tp": rank % tp_size, "dp": (rank // tp_size) % dp_size, "pp": rank // (tp_size * dp_size)}


def custom_dispatch(worker_group, value):
    """Rank i gets 100 * i + value."""
    return ([100 * rank + value for rank in range(worker_group.world_size)],), {}


def custom_collect(worker_group, outputs):
    return sum(outputs)


class ProbeWorker(Worker):
    def __init__(self, tag: str):
        self.tag = tag
        self.received: list = []

    # ------------------------------------------------------------------ environment
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def env(self) -> dict:
        keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
        report = {key: os.environ[key] for key in keys}
        report.update(pid=os.getpid(), tag=self.tag, rank_attr=self.rank)
        if ray.is_initialized():
            report.update(node_id=ray.get_runtime_context().get_node_id())
        return report

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def all_reduce_rank_plus_one(self) -> float:
        import torch.distributed as dist

        if not dist.is_initialized():
            dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))  # env:// from the group
        value = torch.tensor([float(self.rank + 1)])
        dist.all_reduce(value)
        return value.item()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def register_megatron_ranks(self, dp_size: int, tp_size: int, pp_size: int) -> None:
        ranks = megatron_order(self.rank, dp_size, tp_size, pp_size)
        self.set_parallel_ranks(ParallelRanks(**ranks, dp_size=dp_size, tp_size=tp_size, pp_size=pp_size))

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def take_received(self) -> list:
        """What this rank received since the last call (and forget it)."""
        received, self.received = self.received, []
        return received

    # ------------------------------------------------------------------ one method per dispatch mode
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def echo(self, value, key=None):
        return (self.rank, value, key)

    @register(dispatch_mode=Dispatch.ALL_TO_ALL)
    def per_rank(self, value):
        return (self.rank, value)

    @register(dispatch_mode=Dispatch.RANK_ZERO)
    def on_rank_zero(self, value):
        return (self.rank, value)

    @register(dispatch_mode=Dispatch.DP_COMPUTE)
    def dp_compute(self, value):
        return (self.rank, value)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def double(self, data: DataProto) -> DataProto:
        return self._respond(data, data.batch["x"] * 2)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO_WITH_FUNC)
    def apply(self, fn, data: DataProto) -> DataProto:
        return self._respond(data, fn(data.batch["x"]))

    @register(dispatch_mode=Dispatch.DP_COMPUTE_METRIC)
    def metric(self, data: DataProto) -> dict:
        self.received.append(data.batch["x"].tolist())
        return {"rank": self.rank, "rows": len(data), "sum": int(data.batch["x"].sum())}

    @register(dispatch_mode=Dispatch.MEGATRON_COMPUTE)
    def megatron(self, value):
        return (self.rank, value)

    @register(dispatch_mode=Dispatch.MEGATRON_COMPUTE_PROTO)
    def times_ten(self, data: DataProto) -> DataProto:
        return self._respond(data, data.batch["x"] * 10)

    @register(dispatch_mode=Dispatch.MEGATRON_COMPUTE_PROTO, blocking=False)
    def plus_one_later(self, data: DataProto) -> DataProto:
        return self._respond(data, data.batch["x"] + 1)

    @register(dispatch_mode=Dispatch.MEGATRON_PP_AS_DP_PROTO)
    def pp_as_dp(self, data: DataProto) -> DataProto:
        return self._respond(data, data.batch["x"] * 10)

    @register(dispatch_mode={"dispatch_fn": custom_dispatch, "collect_fn": custom_collect})
    def custom(self, value):
        return value + self.rank

    # ------------------------------------------------------------------ failures
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def fail_on(self, rank: int, message: str):
        if self.rank == rank:
            raise ValueError(message)
        return self.rank

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def exit_on(self, rank: int, others_sleep_s: float):
        """`rank` dies; the others wait like a collective whose peer died."""
        if self.rank == rank:
            os._exit(1)
        time.sleep(others_sleep_s)
        return self.rank

    def not_registered(self):
        return self.rank

    def _respond(self, data: DataProto, x: torch.Tensor) -> DataProto:
        self.received.append(data.batch["x"].tolist())
        rank_column = torch.full((len(data),), self.rank, dtype=torch.int64)
        return DataProto.from_dict({"x": x, "rank": rank_column})


class _NamedRole(Worker):
    """What both colocated test roles offer: who they are and a pure data-parallel layout."""

    def __init__(self, name: str):
        self.name = name

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def whoami(self):
        return (self.name, self.rank, os.getpid())

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def setup(self, dp_size: int):
        self.set_parallel_ranks(
            ParallelRanks(dp=self.rank, tp=0, pp=0, dp_size=dp_size, tp_size=1, pp_size=1)
        )


class ActorRole(_NamedRole):
    @register(dispatch_mode=Dispatch.MEGATRON_COMPUTE_PROTO)
    def generate_sequences(self, data: DataProto) -> DataProto:
        return DataProto.from_dict({"responses": data.batch["x"] + 1000})


class CriticRole(_NamedRole):
    @register(dispatch_mode=Dispatch.MEGATRON_COMPUTE_PROTO)
    def compute_values(self, data: DataProto) -> DataProto:
        return DataProto.from_dict({"values": data.batch["x"].float() / 2})


class TeardownRole(_NamedRole):
    """Writes `<marker_dir>/<name>-rank<r>` (holding its pid) when torn down."""

    def __init__(self, name: str, marker_dir: str, fail_teardown: bool = False):
        super().__init__(name)
        self.marker_dir = marker_dir
        self.fail_teardown = fail_teardown

    def teardown(self) -> None:
        if self.fail_teardown:
            raise RuntimeError(f"{self.name} could not stop its engine")
        Path(self.marker_dir, f"{self.name}-rank{self.rank}").write_text(str(os.getpid()))

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def busy_on(self, rank: int):
        """`rank` never returns, like a rank waiting in a collective for a dead peer."""
        if self.rank == rank:
            threading.Event().wait()
        return self.rank


ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


class PlacementProbe(Worker):
    """Runs `engines.placement` in a Ray worker, as the Megatron and rollout workers do on GPUs."""

    def __init__(self, role: str):
        self.role = role

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def placement(self, rollout_tps: list[int]) -> dict:
        import torch.distributed as dist

        from engines.placement import (
            gather_engine_devices,
            this_process_slot,
            training_device_index,
            visible_devices,
        )

        if not dist.is_initialized():
            dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
        visible = visible_devices(os.environ.get("CUDA_VISIBLE_DEVICES"), device_count=0)
        engines = {}
        for rollout_tp in rollout_tps:
            try:
                plan = gather_engine_devices(rollout_tp, device_count=0)
                engines[rollout_tp] = None if plan is None else [list(plan.visible_devices), plan.base_gpu_id]
            except ValueError as err:
                engines[rollout_tp] = f"error: {err}"
        return {
            "role": self.role,
            "pid": os.getpid(),
            "ray_gpu_ids": [str(gpu) for gpu in ray.get_gpu_ids()],
            "visible": visible,
            "training_index": training_device_index(visible, self.local_rank),
            "slot": this_process_slot(device_count=0).device,
            "node": ray.get_runtime_context().get_node_id(),
            "engines": {str(k): v for k, v in engines.items()},
        }


class GateWorker(Worker):
    """A call that waits for a gate another call opens: both end only when the actor runs them
    side by side (Ray's `max_concurrency`)."""

    def __init__(self):
        self.gate = threading.Event()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def wait_for_gate(self, timeout_s: float) -> bool:
        return self.gate.wait(timeout_s)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def open_gate(self) -> None:
        self.gate.set()
