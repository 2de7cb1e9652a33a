"""Delta weight transfer, the pure part: only the elements that changed since the receiver's copy.

After an optimizer step at an RL learning rate most bf16 weights round to the value they had, so a
transfer of the changed elements and their positions moves a small share of the bytes. The delta is
taken over the raw bits (each tensor viewed as the integer type of its element size), so it is
lossless whatever the values are: -0.0 and 0.0 differ, a NaN keeps its payload, and the receiver's
tensor is bit-identical to the sender's. Every tensor's delta carries the sender's `tensor_checksum`
of the new tensor (the checksum that sync verification computes): the receiver checks its result
against it, so a receiver whose copy was not the sender's base is caught, never loaded.

    sender:   delta = encode_tensor(base, new)          # base: what the receiver holds (None: nothing)
    receiver: new = decode_tensor(name, held, delta)    # bit-identical to the sender's, or WeightSyncError

The positions go as a list (int32) or, where more than one element in 32 changed, as a bitmask
of the tensor's elements (one bit each), whichever is smaller. A tensor is sent whole (`indices`
None) where the receiver holds none of it, where its shape or dtype changed (a layout change), or
where positions and values would take as many bytes as the tensor. A full transfer after a
restart is every tensor with no base. `DeltaStats` counts what a transfer moved against a full
one: bytes sent, bytes of the full tensors, changed share.

`DeltaBase` is one side's copy of the weights last transferred, in the transfer's dtype (the rollout
dtype: what a full transfer's engine holds once it cast the actor's tensors), and the version it is
complete for; `pack_deltas` / `unpack_deltas` turn a bucket's deltas into the header entries and the
tensors a transfer moves (engines/weight_sync/transfer.py) and back.
"""

from dataclasses import dataclass, field

import numpy as np
import torch

from engines.weight_sync.common import WeightSyncError, tensor_checksum, torch_dtype

BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # element size -> its bits' type


@dataclass(frozen=True)
class TensorDelta:
    """One tensor's transfer: the changed elements at their flat positions, or the whole tensor."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    # the changed elements' flat positions: (K,) int32 / int64, or a (ceil(N/8),) uint8 bitmask of them
    # where that is smaller (more than one element in 32 changed); None: the tensor whole
    indices: torch.Tensor | None
    values: torch.Tensor  # (K,) the new tensor's elements there, or (N,) all of them, in its dtype
    checksum: str  # tensor_checksum of the new tensor

    def nbytes(self) -> int:
        """Bytes of positions and values (what the transfer moves for this tensor)."""
        index_bytes = 0 if self.indices is None else self.indices.numel() * self.indices.element_size()
        return index_bytes + self.values.numel() * self.values.element_size()

    def changed(self) -> int:
        """Elements sent: the changed ones, or all of a whole tensor."""
        return self.values.numel()


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's elements as integers of the same size, flat (N,): equal iff bit-identical."""
    return tensor.detach().contiguous().reshape(-1).view(BITS[tensor.element_size()])


def index_dtype(numel: int) -> torch.dtype:
    return torch.int32 if numel < 2**31 else torch.int64


def changed_positions(base: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """(K,) flat positions where `new`'s bits differ from `base`'s (same shape and dtype)."""
    return (bits(base) != bits(new)).nonzero().squeeze(1).to(index_dtype(new.numel()))


def pack_mask(positions: torch.Tensor, numel: int) -> torch.Tensor:
    """The positions (K,) as a bitmask of the N elements, 8 to a byte: (ceil(N/8),) uint8."""
    mask = np.zeros(numel, dtype=bool)
    mask[positions.numpy()] = True
    return torch.from_numpy(np.packbits(mask, bitorder="little"))


def delta_positions(indices: torch.Tensor, numel: int) -> torch.Tensor:
    """(K,) int64 positions of a delta's `indices` (positions or a `pack_mask` bitmask)."""
    if indices.dtype != torch.uint8:
        return indices.long()
    mask = np.unpackbits(indices.numpy(), count=numel, bitorder="little").astype(bool)
    return torch.from_numpy(np.flatnonzero(mask))


def encode_tensor(base: torch.Tensor | None, new: torch.Tensor) -> TensorDelta:
    """What the receiver holding `base` (None: nothing, as after a restart) needs to hold `new`:
    the changed elements at their positions (as a list or a bitmask, whichever is smaller), or the
    tensor whole where that is no larger."""
    shape, checksum = tuple(new.shape), tensor_checksum(new)
    flat = new.detach().contiguous().reshape(-1)  # (N,)
    if base is None or tuple(base.shape) != shape or base.dtype != new.dtype:
        return TensorDelta(shape, new.dtype, None, flat.clone(), checksum)
    positions = changed_positions(base, new)  # (K,)
    mask_bytes = -(-new.numel() // 8)
    index_bytes = min(positions.numel() * positions.element_size(), mask_bytes)
    if index_bytes + positions.numel() * new.element_size() >= new.numel() * new.element_size():
        return TensorDelta(shape, new.dtype, None, flat.clone(), checksum)  # no smaller than whole
    values = bits(new)[positions.long()].view(new.dtype)  # (K,) gathered as bits: NaN payloads kept
    if index_bytes < positions.numel() * positions.element_size():
        positions = pack_mask(positions, new.numel())  # (ceil(N/8),)
    return TensorDelta(shape, new.dtype, positions, values, checksum)


def decode_tensor(name: str, held: torch.Tensor | None, delta: TensorDelta) -> torch.Tensor:
    """The sender's new tensor from the receiver's copy `held` and the delta, checked against the
    sender's checksum; WeightSyncError naming the tensor where `held` was not the delta's base."""
    if delta.indices is None:
        out = delta.values.clone().view(delta.shape)
    elif held is None or tuple(held.shape) != delta.shape or held.dtype != delta.dtype:
        raise WeightSyncError(
            f"delta weight transfer: {name} came as changed elements, but this receiver holds "
            f"{'no copy' if held is None else f'{held.dtype} {list(held.shape)}'} to apply them to "
            f"({delta.dtype} {list(delta.shape)} expected); a full transfer is needed"
        )
    else:
        out = held.detach().clone().contiguous()
        positions = delta_positions(delta.indices, out.numel())  # (K,)
        bits(out)[positions] = bits(delta.values)  # (K,) bits written, not values: lossless
    if tensor_checksum(out) != delta.checksum:
        raise WeightSyncError(
            f"delta weight transfer: {name} differs from the sender's after applying the delta (its "
            "checksum does not match): this receiver's copy was not the version the delta was taken "
            "against; a full transfer is needed"
        )
    return out


@dataclass
class DeltaStats:
    """What one transfer moved: bytes sent, bytes of the full tensors, elements sent and in all."""

    sent_bytes: int = 0
    full_bytes: int = 0
    changed: int = 0
    elements: int = 0

    def add(self, delta: TensorDelta) -> None:
        numel = torch.Size(delta.shape).numel()
        self.sent_bytes += delta.nbytes()
        self.full_bytes += numel * delta.values.element_size()
        self.changed += delta.changed()
        self.elements += numel

    def add_whole(self, tensor: torch.Tensor) -> None:
        """A tensor sent whole by a full transfer."""
        nbytes = tensor.numel() * tensor.element_size()
        self.sent_bytes += nbytes
        self.full_bytes += nbytes
        self.changed += tensor.numel()
        self.elements += tensor.numel()

    def merge(self, other: "DeltaStats") -> None:
        """`other`'s counts added to these (several transfers between two steps' metrics)."""
        self.sent_bytes += other.sent_bytes
        self.full_bytes += other.full_bytes
        self.changed += other.changed
        self.elements += other.elements

    def metrics(self) -> dict[str, float]:
        """`weight_sync/bytes_sent`, `weight_sync/bytes_full` (a full transfer's), and the share of
        elements sent (`weight_sync/changed_share`: 1.0 for a full transfer)."""
        return {
            "weight_sync/bytes_sent": float(self.sent_bytes),
            "weight_sync/bytes_full": float(self.full_bytes),
            "weight_sync/changed_share": self.changed / max(self.elements, 1),
        }


@dataclass
class DeltaBase:
    """One side's copy of the weights last transferred (the sender's: what it sent; a receiver's:
    what it loaded), in the transfer's dtype, on the CPU; `version` is the policy version the copy is
    complete for, None while a transfer is under way or after one failed (the next one is full)."""

    dtype: torch.dtype  # the rollout dtype: deltas are taken over what the engine holds
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    version: int | None = None

    def encode(self, name: str, tensor: torch.Tensor, against_base: bool) -> TensorDelta:
        """The delta of `tensor` (cast to `dtype`) against the copy (whole unless `against_base`);
        the cast tensor becomes the copy."""
        new = tensor.detach().to(device="cpu", dtype=self.dtype, copy=True)
        delta = encode_tensor(self.tensors.get(name) if against_base else None, new)
        self.tensors[name] = new
        return delta

    def decode(self, name: str, delta: TensorDelta) -> torch.Tensor:
        """The sender's tensor from the copy and `delta` (checked: `decode_tensor`); it becomes the copy."""
        out = decode_tensor(name, self.tensors.get(name), delta)
        self.tensors[name] = out
        return out


# How a tensor travels: its values only (whole), positions then values (sparse), or nothing (same).
WHOLE, SPARSE, SAME = "whole", "sparse", "same"


def pack_deltas(deltas: list[tuple[str, TensorDelta]]) -> tuple[list[tuple], list[torch.Tensor]]:
    """A bucket's header entries (name, shape, dtype name, checksum, kind) and the tensors to move, in
    order: a sparse delta's positions and values, a whole tensor's values, nothing for an unchanged one."""
    entries, parts = [], []
    for name, delta in deltas:
        kind = WHOLE if delta.indices is None else SPARSE if delta.changed() else SAME
        entries.append((name, delta.shape, str(delta.dtype).removeprefix("torch."), delta.checksum, kind))
        parts += {WHOLE: [delta.values], SPARSE: [delta.indices, delta.values], SAME: []}[kind]
    return entries, parts


def unpack_deltas(entries: list[tuple], parts: list[torch.Tensor]) -> list[tuple[str, TensorDelta]]:
    """The inverse of `pack_deltas`: each entry's delta from the tensors received, in order."""
    deltas, taken = [], iter(parts)
    for name, shape, dtype_name, checksum, kind in entries:
        dtype = getattr(torch, dtype_name)
        if kind == WHOLE:
            indices, values = None, next(taken)
        elif kind == SPARSE:
            indices, values = next(taken), next(taken)
        else:
            indices, values = torch.empty(0, dtype=torch.int32), torch.empty(0, dtype=dtype)
        deltas.append((name, TensorDelta(tuple(shape), dtype, indices, values, checksum)))
    return deltas


def delta_dtype(rollout) -> torch.dtype | None:
    """The dtype a rollout config's delta transfers are taken in (the engine's, rollout.dtype),
    None for full transfers (rollout.weight_sync_delta off); both ends of a transfer call it."""
    return torch_dtype(rollout.dtype) if rollout.weight_sync_delta else None
