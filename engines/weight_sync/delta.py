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

A tensor is sent whole (`indices` None) where the receiver holds none of it, where its shape or
dtype changed (a layout change), or where positions and values would take as many bytes as the
tensor. A full transfer after a restart is every tensor with no base. `DeltaStats` counts what a
transfer moved against a full one: bytes sent, bytes of the full tensors, changed share.
"""

from dataclasses import dataclass

import torch

from engines.weight_sync.common import WeightSyncError, tensor_checksum

BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # element size -> its bits' type


@dataclass(frozen=True)
class TensorDelta:
    """One tensor's transfer: the changed elements at their flat positions, or the whole tensor."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    indices: torch.Tensor | None  # (K,) int32 / int64 flat positions of the changed elements; None: whole
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


def encode_tensor(base: torch.Tensor | None, new: torch.Tensor) -> TensorDelta:
    """What the receiver holding `base` (None: nothing, as after a restart) needs to hold `new`."""
    shape, checksum = tuple(new.shape), tensor_checksum(new)
    flat = new.detach().contiguous().reshape(-1)  # (N,)
    if base is None or tuple(base.shape) != shape or base.dtype != new.dtype:
        return TensorDelta(shape, new.dtype, None, flat.clone(), checksum)
    positions = changed_positions(base, new)  # (K,)
    sparse_bytes = positions.numel() * (positions.element_size() + new.element_size())
    if sparse_bytes >= new.numel() * new.element_size():  # positions would cost more than the tensor
        return TensorDelta(shape, new.dtype, None, flat.clone(), checksum)
    values = bits(new)[positions.long()].view(new.dtype)  # (K,) gathered as bits: NaN payloads kept
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
        bits(out)[delta.indices.long()] = bits(delta.values)  # (K,) bits written, not values: lossless
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

    def metrics(self) -> dict[str, float]:
        """`weight_sync/bytes_sent`, `weight_sync/bytes_full` (a full transfer's), and the share of
        elements sent (`weight_sync/changed_share`: 1.0 for a full transfer)."""
        return {
            "weight_sync/bytes_sent": float(self.sent_bytes),
            "weight_sync/bytes_full": float(self.full_bytes),
            "weight_sync/changed_share": self.changed / max(self.elements, 1),
        }
