"""Which CUDA device each worker process trains on, and which GPUs each rollout engine sees.

Plain functions of a process's environment, so CPU tests (Ray with fake GPUs) run the very code
the GPU path runs.

- Training device. Ray gives a worker that asks for one GPU exactly that GPU
  (`CUDA_VISIBLE_DEVICES` narrowed to it), so its device is `cuda:0` whatever its `LOCAL_RANK`
  (its slot index on the node). Under torchrun every process sees the whole node and `LOCAL_RANK`
  picks the device. `training_device_index` covers both.
- Rollout engines. SGLang starts one scheduler process per TP rank of an engine, on GPUs
  `base_gpu_id + i` of the devices *its* process sees. The engine is built in the first process of
  its rollout group, which (under Ray) sees one GPU; so the engine is started with
  `CUDA_VISIBLE_DEVICES` set to the group's GPUs, in group-rank order, and `base_gpu_id=0`:
  scheduler i then runs on the GPU of group member i, the process whose weights (CUDA-IPC
  handles) it loads. Handles cannot cross nodes, so a group must lie on one node.
"""

import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass

from hybridflow.parallel_ranks import NODE_ID_ENV  # the worker group sets it: the slot's Ray node id


@dataclass(frozen=True)
class DeviceSlot:
    """One worker process's GPU: the node it runs on and the device's name in CUDA_VISIBLE_DEVICES
    terms (an index or a UUID, as the node names it)."""

    node_id: str
    device: str


@dataclass(frozen=True)
class EngineDevices:
    """How one rollout engine is started: the CUDA_VISIBLE_DEVICES of its process and base_gpu_id."""

    visible_devices: tuple[str, ...]
    base_gpu_id: int

    @property
    def cuda_visible_devices(self) -> str:
        return ",".join(self.visible_devices)


def visible_devices(cuda_visible_devices: str | None, device_count: int) -> list[str]:
    """The devices a process sees: CUDA_VISIBLE_DEVICES when set, else all `device_count` of them."""
    if cuda_visible_devices is None:
        return [str(i) for i in range(device_count)]
    devices = [d.strip() for d in cuda_visible_devices.split(",") if d.strip()]
    if len(set(devices)) != len(devices):
        raise ValueError(f"CUDA_VISIBLE_DEVICES={cuda_visible_devices!r} names a device twice")
    return devices


def training_device_index(visible: Sequence[str], local_rank: int) -> int:
    """The CUDA ordinal (within `visible`) this process trains on.

    One visible device (Ray's narrowing): 0. Several (torchrun on a whole node): `local_rank`.
    """
    if not visible:
        raise RuntimeError("no CUDA device is visible to this process (CUDA_VISIBLE_DEVICES is empty)")
    if len(visible) == 1:
        return 0
    if not 0 <= local_rank < len(visible):
        raise RuntimeError(
            f"LOCAL_RANK={local_rank} but this process sees {len(visible)} devices "
            f"(CUDA_VISIBLE_DEVICES={','.join(visible)}); start one process per visible device, "
            "or let Ray assign one GPU per worker"
        )
    return local_rank


def device_slot(node_id: str, visible: Sequence[str], local_rank: int) -> DeviceSlot:
    """This process's training GPU, named as its node names it."""
    return DeviceSlot(node_id=node_id, device=visible[training_device_index(visible, local_rank)])


def rollout_group(rank: int, rollout_tp: int) -> tuple[int, int]:
    """(rollout group index, rank within it): groups are `rollout_tp` consecutive global ranks."""
    if rollout_tp < 1:
        raise ValueError(f"rollout.tensor_model_parallel_size must be >= 1, got {rollout_tp}")
    return divmod(rank, rollout_tp)


def engine_devices(members: Sequence[DeviceSlot]) -> EngineDevices:
    """The devices of the engine serving a rollout group, given each member's slot in group order."""
    nodes = sorted({m.node_id for m in members})
    if len(nodes) != 1:
        raise ValueError(
            f"a rollout engine's ranks must share one node (CUDA-IPC weight handles do not cross "
            f"nodes), but this group spans nodes {nodes}; make rollout.tensor_model_parallel_size "
            "divide trainer.n_gpus_per_node"
        )
    devices = tuple(m.device for m in members)
    if len(set(devices)) != len(devices):
        raise ValueError(
            f"the ranks of one rollout group share GPUs {list(devices)}; each rank needs its own GPU "
            "(is the worker pool colocating several processes per GPU?)"
        )
    return EngineDevices(visible_devices=devices, base_gpu_id=0)


def engine_devices_by_rank(slots: Sequence[DeviceSlot], rollout_tp: int) -> list[EngineDevices | None]:
    """For every global rank: its engine's devices if it builds one (first rank of its group), else None."""
    if len(slots) % rollout_tp:
        raise ValueError(
            f"world size {len(slots)} is not a multiple of rollout.tensor_model_parallel_size={rollout_tp}"
        )
    plans: list[EngineDevices | None] = []
    for rank in range(len(slots)):
        group, member = rollout_group(rank, rollout_tp)
        group_slots = slots[group * rollout_tp : (group + 1) * rollout_tp]
        plans.append(engine_devices(group_slots) if member == 0 else None)
    return plans


def this_process_slot(device_count: int) -> DeviceSlot:
    """This process's slot, from its environment (CUDA_VISIBLE_DEVICES, LOCAL_RANK, node id)."""
    visible = visible_devices(os.environ.get("CUDA_VISIBLE_DEVICES"), device_count)
    node = os.environ.get(NODE_ID_ENV) or socket.gethostname()
    return device_slot(node, visible, int(os.environ.get("LOCAL_RANK", "0")))


def gather_engine_devices(rollout_tp: int, device_count: int) -> EngineDevices | None:
    """Collective over the default process group: this rank's engine devices (None off engine ranks)."""
    import torch.distributed as dist

    slots: list[DeviceSlot | None] = [None] * dist.get_world_size()
    dist.all_gather_object(slots, this_process_slot(device_count))
    return engine_devices_by_rank(slots, rollout_tp)[dist.get_rank()]
