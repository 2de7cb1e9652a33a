"""Sequence-length balancing across data-parallel ranks.

The worker groups split a batch into DP contiguous, equal-sized chunks; reordering the batch so
each chunk holds a similar number of tokens keeps one rank from waiting on another with all the
long responses.
"""

import heapq


def balanced_partitions(token_counts: list[int], num_partitions: int) -> list[list[int]]:
    """Splits sample indices into `num_partitions` groups of equal size with similar token sums.

    Greedy longest-processing-time: take samples longest first and give each to the group with
    the fewest tokens that still has room. Within a group, indices keep ascending order.
    """
    if num_partitions < 1 or len(token_counts) % num_partitions:
        raise ValueError(
            f"{len(token_counts)} samples do not split into {num_partitions} equal data-parallel chunks"
        )
    capacity = len(token_counts) // num_partitions
    groups: list[list[int]] = [[] for _ in range(num_partitions)]
    heap = [(0, p) for p in range(num_partitions)]  # (tokens so far, partition), only groups with room
    for index in sorted(range(len(token_counts)), key=lambda i: (-token_counts[i], i)):
        tokens, partition = heapq.heappop(heap)
        groups[partition].append(index)
        if len(groups[partition]) < capacity:
            heapq.heappush(heap, (tokens + token_counts[index], partition))
    return [sorted(group) for group in groups]


def balanced_order(token_counts: list[int], num_partitions: int) -> list[int]:
    """A permutation of the samples whose `num_partitions` contiguous chunks are balanced."""
    return [i for group in balanced_partitions(token_counts, num_partitions) for i in group]
