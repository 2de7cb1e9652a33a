"""Sequence-length balancing across data-parallel ranks (a pure function)."""

import random

import pytest

from hybridflow.trainer.balance import balanced_order, balanced_partitions


def _chunk_sums(counts, order, k):
    size = len(order) // k
    return [sum(counts[i] for i in order[c * size : (c + 1) * size]) for c in range(k)]


def test_hand_computed_example_is_perfectly_balanced():
    counts = [10, 1, 9, 2, 8, 3, 7, 4]  # sums to 44: two chunks of 22 are possible
    parts = balanced_partitions(counts, 2)
    assert sorted(len(p) for p in parts) == [4, 4]
    assert sorted(sum(counts[i] for i in p) for p in parts) == [22, 22]


def test_order_is_a_permutation_with_equal_chunks_and_a_smaller_spread():
    rng = random.Random(0)
    counts = sorted(rng.randint(5, 500) for _ in range(64))  # worst case for contiguous chunks
    order = balanced_order(counts, 4)
    assert sorted(order) == list(range(64))
    before = _chunk_sums(counts, list(range(64)), 4)
    after = _chunk_sums(counts, order, 4)
    assert max(after) - min(after) <= max(counts)  # LPT bound for equal-size groups
    assert max(after) - min(after) < (max(before) - min(before)) / 10


def test_one_partition_keeps_the_order_and_uneven_splits_are_rejected():
    assert balanced_order([3, 1, 2], 1) == [0, 1, 2]
    with pytest.raises(ValueError, match="5 samples do not split into 2"):
        balanced_partitions([1] * 5, 2)
