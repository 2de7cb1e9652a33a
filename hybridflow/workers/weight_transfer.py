"""Weights from the actor to rollout engines in other processes (trainer.placement=disaggregated).

The actor's rank that holds full tensors (rank 0 of the actor's job, which the colocated weight
stream `engines.megatron.weights.iter_hf_tensors` already gives every rank) and the rollout
engines form a process group of their own: a TCPStore rendezvous hosted by the sender, then a
gloo (CPU) or NCCL (CUDA) group built on it directly. It is not the default group (the actor's
Megatron world and each engine's world stay as they are) and it never enters torch.distributed's
group registry, so nothing else can reach it by accident.

One transfer is a sequence of broadcasts from rank 0, one header and one payload per bucket:

    header  (pickled)  {"version": v, "tensors": [(name, shape, dtype, offset), ...]}
    payload (uint8)    the bucket's tensors' bytes, each at a 16-byte-aligned offset
    ...
    header             {"version": v, "tensors": None}: the transfer is over

Buckets are those of the colocated sync (`bucket_named_tensors`, `rollout.weight_sync_bucket_mb`).
Each receiver loads the buckets into its engine inside one weight-update session (the engine's own
load path, as the colocated sharding manager does) and then serves policy version v.

    sender = WeightSender(transfer_group(host, port, 0, 1 + engines, "gloo"), bucket_mb=512)
    sender.send(iter_hf_tensors(chunks, hf_config), version=step)
    receiver = WeightReceiver(transfer_group(host, port, rank, 1 + engines, "gloo"))
    receiver.load_into(engine)  # -> the policy version the engine now serves
"""

import pickle
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from engines.rollout.weight_sync import WeightSyncError, bucket_named_tensors, tensor_nbytes

ALIGN = 16  # bytes: every tensor of a payload starts at a multiple, so its dtype view is aligned
SENDER = 0
BACKENDS = ("gloo", "nccl")


@dataclass
class TransferGroup:
    """A process group outside torch.distributed's registry, with the store it was built on."""

    store: dist.Store
    group: dist.ProcessGroup
    rank: int
    size: int
    device: torch.device


def transfer_group(
    host: str, port: int, rank: int, size: int, backend: str, timeout_s: float = 600.0
) -> TransferGroup:
    """Collective over the `size` members: rank 0 (the sender) hosts the TCPStore at host:port.
    gloo moves host tensors; nccl moves tensors of this process's current CUDA device."""
    if backend not in BACKENDS:
        raise ValueError(f"weight transfer backend must be one of {BACKENDS}, got {backend!r}")
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, port, size, is_master=rank == SENDER, timeout=timeout)
    store = dist.PrefixStore("weight_transfer", store)
    if backend == "gloo":
        group = dist.ProcessGroupGloo(store, rank, size, timeout)
        device = torch.device("cpu")
    else:
        group = dist.ProcessGroupNCCL(store, rank, size)
        device = torch.device("cuda", torch.cuda.current_device())
    return TransferGroup(store, group, rank, size, device)


def pack_bucket(bucket: list[tuple[str, torch.Tensor]]) -> tuple[list[tuple], torch.Tensor]:
    """The tensors' specs (name, shape, dtype name, byte offset) and their bytes in one flat
    buffer, each tensor at an ALIGN-byte boundary. -> (specs, (N,) uint8)"""
    specs, offset = [], 0
    for name, tensor in bucket:
        specs.append((name, tuple(tensor.shape), str(tensor.dtype).removeprefix("torch."), offset))
        offset = _aligned(offset + tensor_nbytes(tensor))
    flat = torch.zeros(offset, dtype=torch.uint8, device=bucket[0][1].device)  # (N,)
    for (_, _, _, start), (_, tensor) in zip(specs, bucket, strict=True):
        raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8)  # (nbytes,)
        flat[start : start + raw.numel()] = raw
    return specs, flat


def unpack_bucket(specs: list[tuple], flat: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """The inverse of `pack_bucket`: views into `flat`, no copy."""
    bucket = []
    for name, shape, dtype_name, start in specs:
        dtype = getattr(torch, dtype_name)
        nbytes = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
        bucket.append((name, flat[start : start + nbytes].view(dtype).view(shape)))
    return bucket


def payload_size(specs: list[tuple]) -> int:
    """Bytes of the flat buffer `pack_bucket` makes for these specs."""
    _, shape, dtype_name, start = specs[-1]
    element = torch.empty(0, dtype=getattr(torch, dtype_name)).element_size()
    return _aligned(start + torch.Size(shape).numel() * element)


def _aligned(offset: int) -> int:
    return -(-offset // ALIGN) * ALIGN


class WeightSender:
    """Rank 0 of a transfer group: broadcasts the actor's named tensors, bucket by bucket."""

    def __init__(self, group: TransferGroup, bucket_mb: float):
        if group.rank != SENDER:
            raise ValueError(f"the weight sender is rank {SENDER} of its transfer group, not {group.rank}")
        self.group = group
        self.bucket_mb = bucket_mb

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> int:
        """Every tensor of the stream to every receiver, as policy `version`; the bytes sent."""
        sent = 0
        for bucket in bucket_named_tensors(named_tensors, self.bucket_mb):
            specs, flat = pack_bucket([(name, t.to(self.group.device)) for name, t in bucket])
            _broadcast_object(self.group, {"version": version, "tensors": specs})
            _broadcast(self.group, flat)
            sent += flat.numel()
        _broadcast_object(self.group, {"version": version, "tensors": None})
        return sent


class WeightReceiver:
    """A rollout engine's end of a transfer group."""

    def __init__(self, group: TransferGroup):
        if group.rank == SENDER:
            raise ValueError(f"rank {SENDER} of a transfer group sends; receivers are 1..{group.size - 1}")
        self.group = group
        self.version: int | None = None  # the policy version last received
        self.serving: int | None = None  # the policy version last loaded into the engine

    def buckets(self) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """The buckets of one transfer, in order, as they arrive; sets `version` at its end."""
        while True:
            header = _broadcast_object(self.group, None)
            if header["tensors"] is None:
                self.version = header["version"]
                return
            flat = torch.empty(payload_size(header["tensors"]), dtype=torch.uint8, device=self.group.device)
            _broadcast(self.group, flat)
            yield unpack_bucket(header["tensors"], flat)

    def load_into(self, engine) -> int:
        """One transfer into `engine` through its own load path (a weight-update session, then its
        cache flushed); returns the policy version it now serves. A bucket the engine refuses
        raises WeightSyncError after the transfer is received in full (the sender is never left
        waiting), and the engine keeps its previous version."""
        engine.begin_weight_update()
        failure = None
        for index, bucket in enumerate(self.buckets()):
            if failure is None:
                try:
                    engine.update_weights(bucket)
                except (ValueError, WeightSyncError) as err:
                    failure = f"bucket {index} ({bucket[0][0]} .. {bucket[-1][0]}): {err}"
        engine.end_weight_update()
        if failure is not None:
            raise WeightSyncError(f"weight transfer of policy version {self.version}: {failure}")
        engine.flush_cache()
        self.serving = self.version
        return self.serving


def _broadcast(group: TransferGroup, tensor: torch.Tensor) -> None:
    group.group.broadcast([tensor], dist.BroadcastOptions()).wait()


def _broadcast_object(group: TransferGroup, obj):
    """`obj` from the sender to every member (receivers pass None): a length, then pickled bytes."""
    data = pickle.dumps(obj) if group.rank == SENDER else b""
    length = torch.tensor([len(data)], dtype=torch.int64, device=group.device)
    _broadcast(group, length)
    buffer = torch.empty(int(length.item()), dtype=torch.uint8, device=group.device)
    if group.rank == SENDER:
        buffer.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    _broadcast(group, buffer)
    return pickle.loads(buffer.cpu().numpy().tobytes()) if group.rank != SENDER else obj
