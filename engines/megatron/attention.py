"""Core attention on `torch.nn.functional.scaled_dot_product_attention`, as a Megatron module.

Placed into a layer spec at `spec.submodules.self_attention.submodules.core_attention`
(Megatron-Core's extension point); it replaces `DotProductAttention` (which allocates on CUDA)
on CPU, and is also used on GPU so that the padding mask means the same thing everywhere.

Mask contract (Megatron's convention): `attention_mask` is a bool tensor broadcastable to
(b, 1, sq, sk), True where a query may NOT attend to a key; None means plain causal attention.
A query may always attend to itself, so rows whose keys are all masked (padding queries) give
finite values instead of NaN; their outputs are never read for real tokens.

Shapes: inputs are [s, b, heads, head_dim] (Megatron layout); output is [sq, b, heads * head_dim].
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
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("SDPACoreAttention supports neither packed sequences nor attention bias")
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
