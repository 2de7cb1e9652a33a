"""SDPA core attention, the CPU device rewrite and the MoE router without Transformer Engine, in
process (no process groups)."""

import math

import torch
from megatron.core.transformer import TransformerConfig

from engines.megatron import cpu_compat
from engines.megatron.attention import SDPACoreAttention
from engines.megatron.cpu_compat import CudaArgumentsToCpu
from engines.megatron.forward import build_attention_mask


def naive_attention(q, k, v, allowed):
    """Softmax attention written out: q (b, n, s, d), k/v (b, n, s, d), allowed (b, 1, s, s)."""
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    return torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1) @ v


def test_sdpa_attention_matches_naive_gqa_with_padding_and_never_nans():
    config = TransformerConfig(
        num_layers=1, hidden_size=16, num_attention_heads=4, num_query_groups=2, attention_dropout=0.0
    )
    attention = SDPACoreAttention(config, layer_number=1, attn_mask_type=None, attention_type="self")
    torch.manual_seed(0)
    seq, batch, heads, groups, dim = 5, 2, 4, 2, 4
    q = torch.randn(seq, batch, heads, dim)
    k, v = torch.randn(seq, batch, groups, dim), torch.randn(seq, batch, groups, dim)
    pad = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 0]])  # left-padded row, right-padded row
    out = attention(q, k, v, build_attention_mask(pad))  # (s, b, n * d)
    assert out.shape == (seq, batch, heads * dim) and torch.isfinite(out).all()

    bq = q.permute(1, 2, 0, 3)
    bk, bv = (t.permute(1, 2, 0, 3).repeat_interleave(2, dim=1) for t in (k, v))
    allowed = ~build_attention_mask(pad)
    expected = naive_attention(bq, bk, bv, allowed).permute(2, 0, 1, 3).reshape(seq, batch, -1)
    real_query = pad.T.bool()  # (s, b): rows with a real query
    torch.testing.assert_close(out[real_query], expected[real_query])
    # key 4 of row 1 is padding: changing it must not move any real query's output
    k2 = k.clone()
    k2[4, 1] += 10.0
    torch.testing.assert_close(attention(q, k2, v, build_attention_mask(pad))[:4, 1], out[:4, 1])


def test_attention_mask_is_causal_and_hides_padded_keys():
    mask = build_attention_mask(torch.tensor([[0, 1, 1]]))  # (1, 1, 3, 3), True = hidden
    expected_allowed = torch.tensor([[0, 0, 0], [0, 1, 0], [0, 1, 1]], dtype=torch.bool)
    assert torch.equal(~mask[0, 0], expected_allowed)


def test_cuda_device_arguments_run_on_cpu_inside_the_mode():
    with CudaArgumentsToCpu():
        made = torch.zeros(3, device="cuda")
        moved = torch.ones(2).cuda()
        converted = torch.ones(2).to("cuda", dtype=torch.float64)
    assert made.device.type == moved.device.type == converted.device.type == "cpu"
    assert converted.dtype == torch.float64


def test_moe_router_gating_runs_without_transformer_engine(monkeypatch):
    """Megatron-Core 0.16.1 reads `te_general_gemm` only defined when TE imports (a NameError on an
    H200 without TE): once defined as None, the router's linear is its torch fallback, x @ w.T."""
    from megatron.core.transformer.moe import moe_utils

    monkeypatch.delattr(moe_utils, "te_general_gemm", raising=False)
    cpu_compat.define_missing_te_gemm()
    inp, weight = torch.randn(5, 8), torch.randn(3, 8)
    logits = moe_utils.router_gating_linear(inp, weight, None, torch.float32)  # (5, 3)
    torch.testing.assert_close(logits.double(), inp.double() @ weight.double().T, atol=1e-5, rtol=1e-5)
