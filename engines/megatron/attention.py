"""Core attention on `torch.nn.functional.scaled_dot_product_attention`, as a Megatron module.

Placed into the local layer spec at `spec.submodules.self_attention.submodules.core_attention`
(Megatron-Core's extension point); it replaces `DotProductAttention` (which allocates on CUDA and
takes no packed sequences) wherever Transformer Engine does not run: on CPU, and on CUDA without
TE. With TE the spec keeps TE's attention (te_attention.py), which reads the same mask.

Mask contract (Megatron's convention): `attention_mask` is a bool tensor broadcastable to
(b, 1, sq, sk), True where a query may NOT attend to a key; None means plain causal attention.
A query may always attend to itself, so rows whose keys are all masked (padding queries) give
finite values instead of NaN; their outputs are never read for real tokens.

Shapes: inputs are [s, b, heads, head_dim] (Megatron layout); output is [sq, b, heads * head_dim].

Packed sequences (`packed_seq_params` with qkv_format="thd", see packing.py): inputs are
[t, heads, head_dim] holding several sequences back to back; the output is [t, heads * head_dim].
Each sequence is its own causal block through SDPA: the cost grows with sum_i L_i^2, not with
(sum_i L_i)^2 as one block-diagonal mask would (measured in docs/packing.md). Positions past
`cu_seqlens[-1]` (padding for TP / PP shapes) get zeros; no real query reads them.
"""

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule


class SDPACoreAttention(MegatronModule):
    """Drop-in for Megatron's core attention (same constructor and forward signature)."""

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection=None,
    ):
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError(
                "context_parallel_size > 1 needs Transformer Engine attention; the SDPA core attention "
                f"supports only 1, got {config.context_parallel_size}"
            )
        self.layer_number = max(1, layer_number)
        self.softmax_scale = softmax_scale
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type=None,
        attention_bias=None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        if attention_bias is not None:
            raise ValueError("SDPACoreAttention does not support attention bias")
        if packed_seq_params is not None:
            return self._packed(query, key, value, packed_seq_params)
        seq_q, batch, heads, head_dim = query.shape
        groups = key.shape[2]
        # [s, b, n, d] -> [b, n, s, d]; grouped-query attention: each K/V head serves heads/groups queries.
        q = query.permute(1, 2, 0, 3)
        k = key.permute(1, 2, 0, 3).repeat_interleave(heads // groups, dim=1)
        v = value.permute(1, 2, 0, 3).repeat_interleave(heads // groups, dim=1)
        dropout_p = self.dropout_p if self.training else 0.0
        if attention_mask is None:
            out = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, dropout_p=dropout_p, scale=self.softmax_scale
            )  # (b, n, sq, d)
        else:
            seq_k = k.shape[2]
            self_key = torch.eye(seq_q, seq_k, dtype=torch.bool, device=q.device)  # (sq, sk)
            allowed = ~attention_mask | self_key  # (b, 1, sq, sk)
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=allowed, dropout_p=dropout_p, scale=self.softmax_scale
            )  # (b, n, sq, d)
        return out.permute(2, 0, 1, 3).reshape(seq_q, batch, heads * head_dim)

    def _packed(self, query, key, value, params) -> torch.Tensor:
        if params.qkv_format != "thd":
            raise ValueError(f"packed_seq_params.qkv_format must be 'thd', got {params.qkv_format!r}")
        tokens, heads, head_dim = query.shape
        repeat = heads // key.shape[1]
        dropout_p = self.dropout_p if self.training else 0.0
        starts = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q
        lengths = (params.cu_seqlens_q[1:] - params.cu_seqlens_q[:-1]).tolist()
        pieces, end = [], 0  # (L, n, d) blocks in packed order, zeros between and after them
        for start, length in zip(starts[:-1].tolist(), lengths, strict=True):
            if length == 0:
                continue
            if start > end:
                pieces.append(query.new_zeros(start - end, heads, head_dim))
            span = slice(start, start + length)
            q = query[span].transpose(0, 1)  # (n, L, d)
            k = key[span].transpose(0, 1).repeat_interleave(repeat, dim=0)
            v = value[span].transpose(0, 1).repeat_interleave(repeat, dim=0)
            block = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, dropout_p=dropout_p, scale=self.softmax_scale
            )  # (n, L, d)
            pieces.append(block.transpose(0, 1))
            end = start + length
        if tokens > end:
            pieces.append(query.new_zeros(tokens - end, heads, head_dim))
        out = torch.cat(pieces)  # (t, n, d)
        return out.reshape(tokens, heads * head_dim)
