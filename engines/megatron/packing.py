"""Sequence packing (THD layout) and token-budget micro-batches: the decisions, as plain functions.

Packing. A micro-batch of b padded rows (B, T) (left-padded prompt + right-padded response)
becomes one row of its real tokens, row after row, in column order: `pack_micro_batch` returns
input_ids / position_ids (1, T_pack), the cumulative sequence lengths Megatron-Core's
`PackedSeqParams` (qkv_format="thd") carries, and the index maps that bring per-token outputs
back to the (b, R) response layout. Positions restart at 0 for each sequence (Megatron applies
RoPE per `cu_seqlens` segment). T_pack is the real token count rounded up to `length_multiple`
(TP with sequence parallelism scatters the sequence over the TP ranks), or a fixed length given
by the caller (pipeline parallelism sends fixed-shape activations between stages). The padding
tokens form the tail of the last segment of `cu_seqlens_padded`; no real token attends to them.

Token budgets. `partition_by_tokens` assigns rows to k micro-batches, longest first to the
least-loaded one (greedy LPT, Graham 1969), and `token_budget_groups` takes the smallest k, from
ceil(tokens / budget) up, whose partition keeps every micro-batch within the budget, then
agrees on k over the data-parallel group through a callable (`agree_max`) so that every rank
runs the same number of micro-batches.
A rank with fewer rows than k gets empty micro-batches (only padding).

Memory. A packed micro-batch holds at most `max_token_len` real tokens (plus < length_multiple
padding), so its activations are bounded by the budget, whatever the lengths of its sequences.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch


def length_multiple(tensor_parallel_size: int, sequence_parallel: bool, context_parallel_size: int) -> int:
    """What the packed length must divide by: TP when the sequence is split over TP ranks (SP)."""
    if context_parallel_size != 1:
        raise ValueError(
            "sequence packing supports context_parallel_size 1 only (per-sequence CP padding is not "
            f"implemented), got {context_parallel_size}; turn packing off (use_dynamic_bsz: false)"
        )
    return tensor_parallel_size if sequence_parallel else 1


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


@dataclass
class PackedMicroBatch:
    """One packed micro-batch: model inputs (1, T_pack) and the maps back to the padded rows.

    `cu_seqlens` (b + 1,) int32: boundaries of the real tokens of each row; `cu_seqlens_padded`
    equals it except for the last entry, T_pack (the tail padding belongs to the last segment).
    `response_index` (n,): packed position of the output that predicts each real response token
    (row-major over the last R columns of `attention_mask`; every prompt has a real token);
    `last_index` (b,): packed position of each row's last real token.
    """

    input_ids: torch.Tensor  # (1, T_pack)
    position_ids: torch.Tensor  # (1, T_pack)
    cu_seqlens: torch.Tensor  # (b + 1,) int32
    cu_seqlens_padded: torch.Tensor  # (b + 1,) int32
    max_seqlen: int  # longest segment of cu_seqlens_padded
    response_index: torch.Tensor  # (n,) long
    last_index: torch.Tensor  # (b,) long


def pack_micro_batch(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, response_len: int, total: int
) -> PackedMicroBatch:
    """Pack the real tokens of (b, T) rows into one (1, total) row (see the module docstring); the
    last `response_len` columns are the responses, whose real tokens get a `response_index`."""
    real = attention_mask.bool()  # (b, T)
    lengths = real.sum(-1)  # (b,)
    real_tokens = int(lengths.sum())
    if total < max(real_tokens, 1):
        raise ValueError(f"packed length {total} is below the {real_tokens} real tokens of the micro-batch")
    starts = lengths.cumsum(0) - lengths  # (b,) first packed position of each row
    packed_pos = starts[:, None] + real.long().cumsum(-1) - 1  # (b, T) valid where real
    positions = torch.zeros(1, total, dtype=torch.long)
    positions[0, :real_tokens] = (real.long().cumsum(-1) - 1)[real]
    ids = torch.zeros(1, total, dtype=input_ids.dtype)
    ids[0, :real_tokens] = input_ids[real]
    cu_seqlens = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu_seqlens[1:] = lengths.cumsum(0)
    cu_padded = cu_seqlens.clone()
    cu_padded[-1] = total
    # column c - 1 predicts the token in column c; responses occupy the last R columns
    columns = torch.arange(attention_mask.shape[1] - response_len, attention_mask.shape[1])  # (R,)
    predictors = packed_pos[:, columns - 1]  # (b, R)
    response_real = real[:, columns]  # (b, R)
    return PackedMicroBatch(
        input_ids=ids,
        position_ids=positions,
        cu_seqlens=cu_seqlens,
        cu_seqlens_padded=cu_padded,
        max_seqlen=int((cu_padded[1:] - cu_padded[:-1]).max()) if len(lengths) else total,
        response_index=predictors[response_real],
        last_index=starts + lengths - 1,
    )


def packed_lengths(groups: list[list[int]], lengths: list[int], multiple: int, pipelined: bool) -> list[int]:
    """T_pack of each micro-batch: its real tokens rounded up to `multiple` (at least one token);
    with pipeline parallelism, the longest of them for all (fixed-shape p2p transfers)."""
    totals = [round_up(max(sum(lengths[i] for i in group), 1), multiple) for group in groups]
    return [max(totals)] * len(totals) if pipelined else totals


def partition_by_tokens(lengths: list[int], num_groups: int) -> list[list[int]]:
    """`num_groups` groups of row indices with balanced token sums (greedy LPT: longest row first,
    to the group with the fewest tokens; ties to the lower group). Indices ascend within a group."""
    if num_groups < 1:
        raise ValueError(f"num_groups must be >= 1, got {num_groups}")
    loads = [0] * num_groups
    groups: list[list[int]] = [[] for _ in range(num_groups)]
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        target = min(range(num_groups), key=lambda g: (loads[g], g))
        groups[target].append(index)
        loads[target] += lengths[index]
    return [sorted(group) for group in groups]


def _first_fitting_partition(lengths: list[int], budget: int, num_groups: int) -> list[list[int]]:
    """The partition for the smallest k >= num_groups whose every group fits in `budget`."""
    k = num_groups
    while True:
        groups = partition_by_tokens(lengths, k)
        if all(sum(lengths[i] for i in g) <= budget for g in groups):
            return groups
        k += 1


def token_budget_groups(
    lengths: list[int], budget: int, key: str, agree_max: Callable[[int], int] = lambda k: k
) -> list[list[int]]:
    """Row-index groups, one per micro-batch, each holding at most `budget` tokens; the number of
    groups is the same on every rank that shares `agree_max` (an all-reduce MAX over data-parallel
    ranks). ValueError naming `key` if one row alone exceeds the budget."""
    if budget < 1:
        raise ValueError(f"{key} must be >= 1, got {budget}")
    if lengths and max(lengths) > budget:
        raise ValueError(
            f"{key}={budget} is below the longest sequence of the batch ({max(lengths)} tokens, prompt + "
            "response); raise it to at least max_prompt_length + response_length"
        )
    k = max(1, -(-sum(lengths) // budget))
    while True:
        groups = _first_fitting_partition(lengths, budget, k)
        agreed = agree_max(len(groups))
        if agreed == len(groups):
            return groups
        k = agreed  # another rank needs more micro-batches: re-partition into at least that many


def restore_order(per_group: list[torch.Tensor], groups: list[list[int]]) -> torch.Tensor:
    """Concatenate per-group row results and put the rows back in the batch's order."""
    order = torch.tensor([i for group in groups for i in group], dtype=torch.long)
    stacked = torch.cat(per_group)
    out = torch.empty_like(stacked)
    out[order] = stacked
    return out
