"""What every way of moving weights into an engine shares: size-bounded buckets, the name and shape
checks, exact checksums and `WeightSyncError`.

`weight_stream_problem` compares the names and shapes a rollout model takes
(`model_shapes.expected_hf_tensor_shapes`) with what the actor will send, so that a stream the
engine would not take is refused before anything is sent.
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


def weight_stream_problem(
    sent: dict[str, tuple[int, ...]], expected: dict[str, tuple[int, ...]], required: set[str]
) -> str | None:
    """What is wrong with sending tensors of these names and shapes to a model that takes
    `expected` (and needs every name of `required`), or None."""
    for name, shape in sent.items():
        if name not in expected:
            example = next(iter(expected))
            return f"the actor's tensor {name!r} is not one of the rollout model's (names like {example!r})"
        if tuple(shape) != expected[name]:
            theirs = expected[name]
            return f"the actor's tensor {name!r} has shape {tuple(shape)}, the rollout model's {theirs}"
    missing = sorted(required - set(sent))
    if missing:
        count = len(missing)
        return f"the rollout model's tensors {missing[:5]} ({count} in all) are not in the actor's stream"
    return None


def check_named_shapes(
    named_tensors: list[tuple[str, torch.Tensor]], expected: dict[str, tuple[int, ...]]
) -> None:
    """ValueError naming the first tensor of a bucket that `expected` lacks or has another shape."""
    sent = {name: tuple(tensor.shape) for name, tensor in named_tensors}
    problem = weight_stream_problem(sent, expected, required=set())
    if problem is not None:
        raise ValueError(f"update_weights: {problem}")


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
