"""The tensor-parallel gather of the weight stream through shared memory, for a TP group whose
ranks share one host and keep their parameters in host memory (the CPU path, where TP talks gloo).

Why: gloo moves tensors over TCP on loopback with one thread per rank. `weights.iter_hf_tensors`
all-gathered each parameter that way and concatenated the shards: at TP2 on the 76M shape that
took 0.52 s of a 0.70 s sync whose load into vLLM took 0.07 s (docs/engines.md, "Weight sync at
TP2"), and one flattened all-gather was slower still. Here the group maps one shared buffer laid
out as the full tensors: each rank copies its shards into their places, and after one barrier
every rank reads every full tensor in place; no transport, no concatenation, no allocation per
sync.

    staging = TPStaging.create(shards, splits, tp_group)  # collective; None where it does not apply
    staging.fill(shards)        # collective: barrier, this rank's shards in, barrier
    full = staging.full(name)   # the whole tensor: a view of the shared buffer until the next fill

The buffer holds each tensor in HF's row order where that differs from Megatron's only by
blocks (gate/up: `Split(0, parts=2)`), so that the HF tensors are views of it as well.

`create` returns None on every rank alike when the group has one rank, a shard is not in host
memory (CUDA keeps its NCCL all-gather), /dev/shm lacks room, or the ranks do not see the same
/dev/shm (another host or container): the caller then keeps the collective gather. The buffer
holds one full copy of the shards for the life of the object, because mapping it anew at each
sync would pay its page faults every time.
"""

import os
import secrets
import tempfile
from dataclasses import dataclass

import torch
import torch.distributed as dist

SHM_DIR = "/dev/shm"
ALIGN = 64  # bytes: every slot starts on a cache line, so any dtype view of it is aligned
TOKEN_BYTES = 16  # the buffer's first bytes: rank 0's random token, proof that a peer maps the same file


@dataclass(frozen=True)
class Split:
    """How a tensor is split over the group: along `dim`; with `parts` > 1 (along dim 0 only) a
    shard is that many row blocks stacked, each split on its own (Megatron's gate/up: TP rank r
    holds [gate_r; up_r])."""

    dim: int
    parts: int = 1


@dataclass(frozen=True)
class _Slot:
    """Where one full tensor lives in the buffer: (parts, *the full block) from `offset`."""

    offset: int  # bytes
    shape: tuple[int, ...]  # (parts, *block), the block's `split.dim` times the group size
    dtype: torch.dtype
    split: Split
    shard_shape: tuple[int, ...]  # what `fill` takes from each rank


class TPStaging:
    """A shared buffer of full tensors that every rank of one TP group fills with its shards."""

    def __init__(self, storage: torch.UntypedStorage, slots: dict[str, _Slot], group, rank: int):
        self._group = group
        size = dist.get_world_size(group)
        buffer = torch.empty(0, dtype=torch.uint8).set_(storage)
        self._slots = slots
        self._mine, self._full = {}, {}
        for name, slot in slots.items():
            blocks = _view(buffer, slot)
            self._mine[name] = blocks.chunk(size, slot.split.dim + 1)[rank]
            self._full[name] = _megatron_order(blocks, size)

    @classmethod
    def create(cls, shards: dict[str, torch.Tensor], splits: dict[str, Split], group) -> "TPStaging | None":
        """Collective over `group`. `shards`: this rank's shard of each tensor, split as
        `splits[name]` says; every rank passes the same names, shapes and dtypes."""
        size = dist.get_world_size(group)
        on_host = all(shard.device.type == "cpu" for shard in shards.values())
        if size == 1 or not shards or not on_host:  # the same answer on every rank of a TP group
            return None
        slots, nbytes = _layout(shards, splits, size)
        storage = _map_shared(nbytes, group)
        return None if storage is None else cls(storage, slots, group, dist.get_rank(group))

    def __contains__(self, name: str) -> bool:
        return name in self._full

    def fill(self, shards: dict[str, torch.Tensor]) -> None:
        """Collective: this rank's shards into their places of the full tensors."""
        dist.barrier(group=self._group)  # no rank still reads the previous fill's tensors
        for name, shard in shards.items():
            slot, mine = self._slots[name], self._mine[name]
            if tuple(shard.shape) != slot.shard_shape or shard.dtype != slot.dtype:
                got, staged = f"{shard.dtype}{list(shard.shape)}", f"{slot.dtype}{list(slot.shard_shape)}"
                raise ValueError(f"{name}: shard {got}, staged as {staged}")
            mine.copy_(shard.detach().reshape(mine.shape))
        dist.barrier(group=self._group)  # every rank's shards are in

    def full(self, name: str) -> torch.Tensor:
        """The whole tensor in Megatron's layout (its elements in row-major order), a view valid
        until the next `fill`. With `parts` > 1 its shape is (group size, parts, rows, ...): the
        buffer holds each part whole (HF's gate, then up), so splitting them is a view too."""
        return self._full[name]


def _layout(
    shards: dict[str, torch.Tensor], splits: dict[str, Split], size: int
) -> tuple[dict[str, _Slot], int]:
    """Each full tensor's slot after the token, and the buffer's size in bytes."""
    slots, offset = {}, ALIGN
    for name, shard in shards.items():
        split = splits[name]
        shape = [split.parts, shard.shape[0] // split.parts, *shard.shape[1:]]
        shape[split.dim + 1] *= size
        slots[name] = _Slot(offset, tuple(shape), shard.dtype, split, tuple(shard.shape))
        offset += -(-shard.numel() * size * shard.element_size() // ALIGN) * ALIGN
    return slots, offset


def _view(buffer: torch.Tensor, slot: _Slot) -> torch.Tensor:
    nbytes = torch.Size(slot.shape).numel() * slot.dtype.itemsize
    return buffer[slot.offset : slot.offset + nbytes].view(slot.dtype).view(slot.shape)


def _megatron_order(blocks: torch.Tensor, size: int) -> torch.Tensor:
    """(parts, *full block) -> the full tensor in Megatron's order: each rank's parts together."""
    if blocks.shape[0] == 1:
        return blocks[0]
    return blocks.unflatten(1, (size, -1)).transpose(0, 1)


def _map_shared(nbytes: int, group) -> torch.UntypedStorage | None:
    """Collective: one file in /dev/shm mapped by every rank of `group`, or None on every rank.

    The group's first rank creates it (space reserved up front: a tmpfs that runs out later would
    kill the process with SIGBUS at the first write) and writes a random token; a peer maps it
    only if it reads that token back, i.e. it sees the same /dev/shm. The name is removed once all
    have mapped it, so nothing is left behind when a process dies."""
    first = dist.get_global_rank(group, 0)
    offer: list = [_create_file(nbytes) if dist.get_rank() == first else None]
    dist.broadcast_object_list(offer, src=first, group=group)
    path, token = offer[0] or (None, None)
    storage = _open_if_same(path, token, nbytes)
    mapped: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(mapped, storage is not None, group=group)
    if path is not None and dist.get_rank() == first:
        os.unlink(path)  # peers hold it through their mappings
    return storage if all(mapped) else None


def _create_file(nbytes: int) -> tuple[str, bytes] | None:
    if not os.path.isdir(SHM_DIR):
        return None
    fd, path = tempfile.mkstemp(prefix="hybridflow-tp-staging-", dir=SHM_DIR)
    token = secrets.token_bytes(TOKEN_BYTES)
    try:
        os.posix_fallocate(fd, 0, nbytes)
        os.pwrite(fd, token, 0)
    except OSError:  # no room: the group keeps the collective gather
        os.unlink(path)
        return None
    finally:
        os.close(fd)
    return path, token


def _open_if_same(path: str | None, token: bytes | None, nbytes: int) -> torch.UntypedStorage | None:
    if path is None:
        return None
    try:
        with open(path, "rb") as file:
            if file.read(TOKEN_BYTES) != token:
                return None
    except FileNotFoundError:  # another host or another /dev/shm
        return None
    return torch.UntypedStorage.from_file(path, shared=True, nbytes=nbytes)
