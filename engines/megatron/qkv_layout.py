"""Megatron-Core's fused QKV layout, which weights.py (HF <-> Megatron tensors) and lora.py (the
adapters' output rows) both follow: the rows of `linear_qkv` are grouped per KV head,
[q heads of group g, k_g, v_g] for each g, and TP rank r holds the r-th contiguous chunk of that
layout (a part of one group when TP exceeds the KV head count).

Shapes: d head dim.
"""

import torch


def qkv_row_sources(start: int, end: int, groups: int, q_per_group: int, head_dim: int):
    """Rows [start, end) of the fused QKV layout as (0=q|1=k|2=v, src_start, src_end) segments."""
    block = (q_per_group + 2) * head_dim
    parts = (
        (0, 0, q_per_group * head_dim),
        (1, q_per_group * head_dim, block - head_dim),
        (2, block - head_dim, block),
    )
    segments = []
    for g in range(start // block, -(-end // block)):
        for which, lo, hi in parts:
            a, b = max(start, g * block + lo), min(end, g * block + hi)
            if a < b:
                src = g * (hi - lo) + (a - g * block - lo)
                segments.append((which, src, src + b - a))
    return segments


def split_fused_qkv(full: torch.Tensor, groups: int, q_per_group: int, head_dim: int):
    """Full fused QKV (rows grouped per KV head) -> (q, k, v) in HF row order."""
    rest = full.shape[1:]
    blocks = full.reshape(groups, (q_per_group + 2) * head_dim, *rest)
    q_rows = q_per_group * head_dim
    q = blocks[:, :q_rows].reshape(-1, *rest)  # (heads * d, ...)
    k = blocks[:, q_rows : q_rows + head_dim].reshape(-1, *rest)  # (groups * d, ...)
    v = blocks[:, q_rows + head_dim :].reshape(-1, *rest)  # (groups * d, ...)
    return q, k, v
