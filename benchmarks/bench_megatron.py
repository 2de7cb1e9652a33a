"""Megatron engine throughput: `compute_log_prob` and `update_policy` tokens/s (MFU on CUDA).

CPU: the tiny quickstart model (`hybridflow.utils.tiny_model`, ~0.8M parameters, fp32) at TP1
and TP2 (torchrun, gloo, OMP_NUM_THREADS=1 per rank). Batch of 32 rows, 64-token prompts and
64-token responses; log-probs in micro-batches of 8; one PPO mini-batch of 32 (micro 8, one
epoch, clip + entropy + low_var_kl loss). tokens/s (and MFU) count the real, unpadded tokens.
Median of 3 calls after a warm-up.

CUDA (when present): a Qwen2.5-0.5B-shaped random model (config only, no weights read) in bf16
on one GPU, batch 16 x 1024 tokens, and MFU = achieved FLOPs / the GPU's dense bf16 peak, with
FLOPs per token 6 N + 12 L h T for a training step (N matmul parameters incl. the output
layer, L layers, h hidden, T sequence length; PaLM, Chowdhery et al. 2022, appendix B) and a
third of that for a forward pass.

Run: `python -m benchmarks megatron`.
"""

import json
import sys
import tempfile
from pathlib import Path

from benchmarks._timing import median_seconds, run_torchrun

TITLE = "Megatron engine: compute_log_prob / update_policy tokens/s (tiny model on CPU; MFU on CUDA)"
REPEATS = 3
CPU_SHAPE = dict(batch=32, prompt=64, response=64, micro=8)
GPU_SHAPE = dict(batch=16, prompt=512, response=512, micro=4)
QWEN25_05B = dict(
    architectures=["Qwen2ForCausalLM"],
    model_type="qwen2",
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    vocab_size=151936,
    max_position_embeddings=32768,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    hidden_act="silu",
)
# Dense bf16 peak FLOP/s by device-name fragment (vendor data sheets, SXM parts).
PEAK_BF16 = {"H200": 989.4e12, "H100": 989.4e12, "A100": 312e12}


def run() -> list[dict]:
    import torch

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        from hybridflow.utils.tiny_model import make_tiny_model

        tiny = make_tiny_model(tmp / "tiny")
        rows = [*_launch(tiny, 1, "cpu", tmp), *_launch(tiny, 2, "cpu", tmp)]
        if torch.cuda.is_available():
            qwen = tmp / "qwen2.5-0.5b-shaped"
            qwen.mkdir()
            (qwen / "config.json").write_text(json.dumps(QWEN25_05B))
            rows += _launch(qwen, 1, "cuda", tmp)
    return rows


def _launch(model_dir: Path, tp: int, device: str, tmp: Path) -> list[dict]:
    result_file = tmp / f"{device}_tp{tp}.json"
    what = f"megatron benchmark TP{tp} on {device}"
    run_torchrun(__file__, tp, model_dir, tp, device, result_file, what=what)
    return json.loads(result_file.read_text())


def _batch(shape: dict, vocab_size: int):
    """Left-padded prompts (lengths spread over the second half of the window) + right-padded responses."""
    import torch

    from hybridflow.protocol import DataProto

    gen = torch.Generator().manual_seed(0)
    b, p, r = shape["batch"], shape["prompt"], shape["response"]
    prompt_lens = torch.randint(p // 2, p + 1, (b,), generator=gen)
    response_lens = torch.randint(r // 2, r + 1, (b,), generator=gen)
    positions = torch.arange(p + r)
    attention_mask = (
        (positions >= p - prompt_lens[:, None]) & (positions < p + response_lens[:, None])
    ).long()
    input_ids = torch.randint(3, vocab_size, (b, p + r), generator=gen) * attention_mask  # (B, P+R)
    tensors = {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
        "responses": input_ids[:, p:],
        "response_mask": attention_mask[:, p:],
        "advantages": torch.randn(b, r, generator=gen) * attention_mask[:, p:],
    }
    return DataProto.from_dict(tensors=tensors, meta_info={"micro_batch_size": shape["micro"]})


def _flops_per_token(hf, seq_len: int) -> float:
    """Training FLOPs per token, 6 N + 12 L h T (see the module docstring)."""
    h, f, layers = hf.hidden_size, hf.intermediate_size, hf.num_hidden_layers
    kv = hf.num_key_value_heads * hf.head_dim
    per_layer = h * (h + 2 * kv) + h * h + 3 * h * f  # QKV, output projection, gate/up/down
    matmul_params = layers * per_layer + h * hf.vocab_size  # + the output layer
    return 6 * matmul_params + 12 * layers * h * seq_len


def _rows(hf, tp: int, device: str, shape: dict, tokens: int, timings: dict) -> list[dict]:
    import torch

    peak = next(
        (v for k, v in PEAK_BF16.items() if device == "cuda" and k in torch.cuda.get_device_name()), None
    )
    flops = _flops_per_token(hf, shape["prompt"] + shape["response"])
    rows = []
    for op, seconds in timings.items():
        row = {"op": op, "device": device, "layout": f"TP{tp}", "tokens": tokens, "seconds": seconds}
        row["tokens/s"] = tokens / seconds
        op_flops = flops if op == "update_policy" else flops / 3
        row["MFU"] = f"{100 * op_flops * tokens / seconds / peak:.1f}%" if peak else "n/a"
        rows.append(row)
    return rows


def _worker(model_dir: Path, tp: int, device: str, result_file: Path) -> None:
    """Runs on each torchrun rank; rank 0 writes the rows."""
    import torch
    import torch.distributed as dist

    from engines.megatron.actor import MegatronActor
    from engines.megatron.config import ActorUpdateConfig, MegatronConfig, OptimConfig
    from engines.megatron.model import build_model, unwrap_model
    from engines.megatron.optimizer import build_optimizer
    from engines.megatron.parallel import init_megatron

    on_gpu = device == "cuda"
    shape = GPU_SHAPE if on_gpu else CPU_SHAPE
    cfg = MegatronConfig(tensor_model_parallel_size=tp, params_dtype="bfloat16" if on_gpu else "float32")
    init_megatron(cfg)
    chunks = build_model(model_dir, cfg, load_weights=not on_gpu)
    optimizer, scheduler = build_optimizer(chunks, OptimConfig(lr=1e-6), cfg)
    update_cfg = ActorUpdateConfig(
        ppo_mini_batch_size=shape["batch"], ppo_micro_batch_size=shape["micro"], entropy_coeff=0.001,
        use_kl_loss=True,
    )  # fmt: skip
    actor = MegatronActor(chunks, optimizer, scheduler, update_cfg)
    hf = unwrap_model(chunks[0]).hf_config
    data = _batch(shape, hf.vocab_size)
    old = actor.compute_log_prob(data).batch["old_log_probs"]  # every rank is the last stage at PP1
    data.batch["old_log_probs"] = old
    data.batch["ref_log_prob"] = old.clone()
    sync = torch.cuda.synchronize if torch.cuda.is_available() else None
    timings = {
        "compute_log_prob": median_seconds(lambda: actor.compute_log_prob(data), REPEATS, sync),
        "update_policy": median_seconds(lambda: actor.update_policy(data), REPEATS, sync),
    }
    if dist.get_rank() == 0:
        tokens = int(data.batch["attention_mask"].sum())
        result_file.write_text(json.dumps(_rows(hf, tp, device, shape, tokens, timings)))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    _worker(Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3], Path(sys.argv[4]))
