"""Packed (THD) attention on CPU: why the engine runs each sequence as its own causal SDPA block.

One forward pass over 12 sequences of log-normal lengths packed back to back (4 heads of 32, fp32,
one thread), three ways:
- per-sequence blocks: the engine's own `SDPACoreAttention` with `PackedSeqParams` (cost grows
  with sum_i L_i^2);
- one SDPA call over the whole pack with a block-diagonal causal mask (cost (sum_i L_i)^2);
- FlexAttention with a document mask, compiled (`torch.compile`; needs a C++ toolchain, and
  compiles again for each new packed length: the compile time is its own row).
The three alternate over 5 rounds of 5 calls each (median of the rounds' mean per call, spread)
after one warm-up each, with the load sampled
at each round (benchmarks/_conditions.py). Results: docs/packing.md.

Run: `python -m benchmarks attention`.
"""

import time

from benchmarks._conditions import LoadSamples, alternating, ratio_text, summary
from benchmarks.bench_megatron import response_lengths

TITLE = "Packed attention on CPU: per-sequence SDPA blocks vs a block-diagonal mask vs FlexAttention"
REPEATS = 5
CALLS_PER_ROUND = 5  # a single call (tens of ms) is too short to time alone on a shared machine
SEQUENCES, MEDIAN_LENGTH, SIGMA, MAX_LENGTH, HEADS, HEAD_DIM = 12, 200.0, 1.0, 8192, 4, 32


def run() -> list[dict]:
    import torch

    torch.set_num_threads(1)
    lengths = _lengths()
    q, k, v = (torch.randn(int(lengths.sum()), HEADS, HEAD_DIM) for _ in range(3))  # (T, n, d) each
    cases = {
        "per-sequence blocks (engine)": _per_sequence(lengths),
        "one block-diagonal mask": _block_diagonal(lengths),
        "FlexAttention, document mask": _flex(lengths),
    }
    compile_seconds = _timed(lambda: cases["FlexAttention, document mask"](q, k, v))
    _check_same_output(cases, q, k, v)
    loads = LoadSamples()
    timed = {name: _timed_after_warm_up(fn, q, k, v) for name, fn in cases.items()}
    rounds = alternating(timed, REPEATS, loads)
    base = summary(rounds["per-sequence blocks (engine)"])[0]
    rows = [_row(name, seconds, base, loads, lengths) for name, seconds in rounds.items()]
    first_call = _row("FlexAttention: first call (compile)", [compile_seconds], base, loads, lengths)
    rows.append({**first_call, "vs engine": "-"})
    print(loads.text(), flush=True)
    return rows


def _check_same_output(cases: dict, q, k, v) -> None:
    """The three compute the same attention (else their times compare different work)."""
    import torch

    with torch.no_grad():
        outputs = {name: fn(q, k, v).reshape(len(q), -1) for name, fn in cases.items()}  # (T, n*d) each
    reference = outputs.pop("per-sequence blocks (engine)")
    for name, out in outputs.items():
        difference = (out - reference).abs().max().item()
        if difference > 1e-4:
            raise RuntimeError(f"{name} differs from the engine's attention by {difference:.2e}")


def _lengths():
    """bench_megatron's log-normal lengths, uncapped in practice (at most MAX_LENGTH)."""
    shape = dict(batch=SEQUENCES, median=MEDIAN_LENGTH, sigma=SIGMA, response=MAX_LENGTH)
    return response_lengths(shape, seed=0)  # (S,)


def _cu_seqlens(lengths):
    import torch

    return torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).int()  # (S+1,)


def _per_sequence(lengths):
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from engines.megatron.attention import SDPACoreAttention

    config = TransformerConfig(num_layers=1, hidden_size=HEADS * HEAD_DIM, num_attention_heads=HEADS)
    attention = SDPACoreAttention(config, 1, AttnMaskType.padding_causal, "self").eval()
    cu = _cu_seqlens(lengths)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu)
    return lambda q, k, v: attention(q, k, v, None, packed_seq_params=params)


def _block_diagonal(lengths):
    import torch
    import torch.nn.functional as F

    document = torch.repeat_interleave(torch.arange(len(lengths)), lengths)  # (T,)
    position = torch.arange(len(document))
    allowed = (document[:, None] == document[None, :]) & (position[:, None] >= position[None, :])  # (T, T)

    def attend(q, k, v):
        heads_first = (t.transpose(0, 1) for t in (q, k, v))  # (n, T, d) each
        return F.scaled_dot_product_attention(*heads_first, attn_mask=allowed).transpose(0, 1)  # (T, n, d)

    return attend


def _flex(lengths):
    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    document = torch.repeat_interleave(torch.arange(len(lengths)), lengths)  # (T,)

    def same_document_causal(b, h, q_idx, kv_idx):
        return (document[q_idx] == document[kv_idx]) & (q_idx >= kv_idx)

    total = len(document)
    mask = create_block_mask(same_document_causal, None, None, total, total, device="cpu")
    compiled = torch.compile(flex_attention)

    def attend(q, k, v):
        qkv = (t.transpose(0, 1)[None] for t in (q, k, v))  # (1, n, T, d) each
        return compiled(*qkv, block_mask=mask)[0].transpose(0, 1)  # (T, n, d)

    return attend


def _timed(fn) -> float:
    import torch

    with torch.no_grad():
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start


def _timed_after_warm_up(fn, q, k, v):
    """A round's timing: the mean seconds of CALLS_PER_ROUND calls."""
    _timed(lambda: fn(q, k, v))
    return lambda: _timed(lambda: [fn(q, k, v) for _ in range(CALLS_PER_ROUND)]) / CALLS_PER_ROUND


def _row(name: str, seconds: list[float], base: float, loads: LoadSamples, lengths) -> dict:
    median, spread = summary(seconds)
    return {
        "method": name,
        "tokens": int(lengths.sum()),
        "ms": 1000 * median,
        "spread": f"{100 * spread:.0f}%",
        "vs engine": ratio_text(median, base, loads, base="the engine's time"),
    }
