"""Buckets and checksums of the weight sync (single process)."""

import pytest
import torch

from engines.weight_sync.common import (
    MB,
    bucket_named_tensors,
    first_checksum_mismatch,
    tensor_checksum,
)


def named(sizes_in_floats: list[int]) -> list[tuple[str, torch.Tensor]]:
    return [(f"w{i}", torch.full((n,), float(i))) for i, n in enumerate(sizes_in_floats)]


def test_buckets_keep_order_and_respect_the_size_limit():
    quarter_mb = MB // 4 // 4  # floats in a quarter MiB
    tensors = named([quarter_mb, quarter_mb, quarter_mb, quarter_mb, quarter_mb, 5 * quarter_mb, 1])
    buckets = list(bucket_named_tensors(tensors, bucket_mb=0.5))
    assert [[name for name, _ in b] for b in buckets] == [["w0", "w1"], ["w2", "w3"], ["w4"], ["w5"], ["w6"]]
    flat = [pair for bucket in buckets for pair in bucket]
    assert all(a[0] == b[0] and a[1] is b[1] for a, b in zip(flat, tensors, strict=True))  # no copies


def test_buckets_consume_the_stream_lazily():
    consumed = []

    def stream():
        for name, tensor in named([MB // 4] * 4):  # 1 MiB each
            consumed.append(name)
            yield name, tensor

    buckets = bucket_named_tensors(stream(), bucket_mb=2)
    assert [n for n, _ in next(buckets)] == ["w0", "w1"]
    assert consumed == ["w0", "w1", "w2"]  # the third tensor is read to know the first bucket is full
    with pytest.raises(ValueError, match="bucket_mb"):
        next(bucket_named_tensors(stream(), bucket_mb=0))


def test_checksum_is_bit_exact():
    tensor = torch.randn(64, 32)
    assert tensor_checksum(tensor) == tensor_checksum(tensor.clone())
    assert tensor_checksum(tensor.t().contiguous().t()) == tensor_checksum(tensor)  # layout does not matter
    flipped = tensor.clone()
    flipped.view(torch.int32)[3, 5] ^= 1  # one mantissa bit
    assert tensor_checksum(flipped) != tensor_checksum(tensor)
    zeros = torch.zeros(4)
    assert tensor_checksum(zeros) != tensor_checksum(-zeros)  # equal sums, different bytes
    assert tensor_checksum(tensor) != tensor_checksum(tensor.reshape(32, 64))
    assert tensor_checksum(tensor.bfloat16()) != tensor_checksum(tensor.bfloat16().half())
    assert tensor_checksum(tensor.bfloat16()) == tensor_checksum(tensor.bfloat16().clone())


def test_first_mismatch_follows_sync_order():
    sent = {"a": "1", "b": "2", "c": "3"}
    assert first_checksum_mismatch(sent, dict(sent)) is None
    assert first_checksum_mismatch(sent, {"a": "1", "b": "x", "c": "y"}) == "b"
    assert first_checksum_mismatch(sent, {"a": "1", "c": "3"}) == "b"
