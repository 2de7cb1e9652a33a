"""Moving named weight tensors into a rollout engine: size-bounded buckets and exact checksums.

`bucket_named_tensors` groups a stream of (hf_name, tensor) into lists of about `bucket_mb` each
without materialising the stream (the actor's stream is a collective: every rank must consume it
in lockstep). `tensor_checksum` hashes a tensor's raw bytes (with its dtype and shape), so two
tensors have equal checksums exactly when they are bit-identical; `first_checksum_mismatch` names
the first tensor of a sync whose rollout copy differs from what the actor sent.
"""

import hashlib
from collections.abc import Iterable, Iterator

import torch

MB = 1024 * 1024


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a `rollout.dtype` name."""
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def tensor_nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def bucket_named_tensors(
    named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_mb: float
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Consecutive groups of the stream, each at most `bucket_mb` MiB unless a single tensor is larger
    (it then forms a bucket on its own). Order is preserved; no tensor is copied."""
    if bucket_mb <= 0:
        raise ValueError(f"bucket_mb must be > 0, got {bucket_mb}")
    limit = bucket_mb * MB
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named_tensors:
        nbytes = tensor_nbytes(tensor)
        if bucket and size + nbytes > limit:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


def check_named_shapes(
    named_tensors: list[tuple[str, torch.Tensor]], expected: dict[str, tuple[int, ...]]
) -> None:
    """ValueError naming the first tensor whose name is not in `expected` or whose shape differs."""
    for name, tensor in named_tensors:
        if name not in expected:
            example = next(iter(expected))
            raise ValueError(
                f"update_weights: {name!r} is not a weight of the rollout model; "
                f"expected Hugging Face names like {example!r}"
            )
        if tuple(tensor.shape) != expected[name]:
            raise ValueError(
                f"update_weights: {name!r} has shape {tuple(tensor.shape)}, the rollout model's "
                f"weight has {expected[name]}"
            )


def tensor_checksum(tensor: torch.Tensor) -> str:
    """BLAKE2b of the tensor's raw bytes, prefixed with dtype and shape: equal iff bit-identical."""
    flat = tensor.detach().contiguous().reshape(-1).cpu()
    digest = hashlib.blake2b(flat.view(torch.uint8).numpy(), digest_size=16).hexdigest()
    return f"{str(tensor.dtype).removeprefix('torch.')}{list(tensor.shape)}:{digest}"


def first_checksum_mismatch(sent: dict[str, str], received: dict[str, str]) -> str | None:
    """The first name of `sent` (in sync order) whose received checksum differs or is missing."""
    for name, checksum in sent.items():
        if received.get(name) != checksum:
            return name
    return None


class WeightSyncError(RuntimeError):
    """The rollout engine's weights differ from the actor's after a sync."""
