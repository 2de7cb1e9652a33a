"""Transformer Engine's core attention for hybridflow's batches (CUDA with TE; model.layer_spec).

Megatron-Core's `TEDotProductAttention` (flash / cuDNN kernels) is built by the TE layer spec with
the causal mask type. Packed batches (THD, `packed_seq_params`) need nothing more: Megatron turns
causal into TE's "padding_causal" over `cu_seqlens`, the varlen flash path. Padded batches carry
left-padded prompts and right-padded responses with a boolean mask (True = hidden,
forward.build_attention_mask); plain causal would let real tokens attend to the padding, and TE's
"padding" masks assume each row's tokens come first, so those calls use TE's "arbitrary" mask
(a backend that takes a full mask; packing, the GSM8K recipes' setting, is the fast path).
"""

from functools import cache

import torch
from megatron.core.transformer.enums import AttnMaskType


def te_mask_arguments(attention_mask: torch.Tensor | None, packed: bool):
    """(mask, mask type) for one TE call. A query always keeps its own key, so a padding query's row
    is never fully hidden (TE would return NaN there; SDPACoreAttention does the same)."""
    if packed or attention_mask is None:
        return attention_mask, AttnMaskType.causal
    seq_q, seq_k = attention_mask.shape[-2:]
    self_key = torch.eye(seq_q, seq_k, dtype=torch.bool, device=attention_mask.device)  # (sq, sk)
    return attention_mask & ~self_key, AttnMaskType.arbitrary  # (b, 1, sq, sk), True = hidden


@cache
def te_core_attention() -> type:
    """`TEDotProductAttention` taking the padding mask; defined on first use because the base class
    exists only where Transformer Engine imports."""
    from megatron.core.extensions.transformer_engine import TEDotProductAttention

    class PaddingMaskTEAttention(TEDotProductAttention):
        def forward(
            self, query, key, value, attention_mask, attn_mask_type,
            attention_bias=None, packed_seq_params=None, num_splits=None,
        ):  # fmt: skip
            attention_mask, attn_mask_type = te_mask_arguments(attention_mask, packed_seq_params is not None)
            return super().forward(
                query, key, value, attention_mask, attn_mask_type,
                attention_bias=attention_bias, packed_seq_params=packed_seq_params, num_splits=num_splits,
            )  # fmt: skip

    return PaddingMaskTEAttention
