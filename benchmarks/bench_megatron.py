"""Megatron engine throughput, padded vs packed: `compute_log_prob` and `update_policy` tokens/s.

Batch (GSM8K-like): 32 rows, prompts of 48..128 tokens (left-padded to 128), response lengths
drawn from a log-normal with median 150 tokens and log-std 1.0, capped at 1024 (right-padded to
1024): most responses are short, a few hit the cap. tokens/s (and MFU) count the real, unpadded
tokens, so the two modes are compared on the same work.
- padded: (B, 1152) rows, micro-batches of 8 rows (log-probs and update);
- packed: sequence packing (THD) with token-budget micro-batches, `use_dynamic_bsz` with
  `max_token_len_per_gpu` = 4096 (update) and 8192 (log-probs).
One PPO mini-batch of 32 (one epoch, clip + entropy + low_var_kl loss). Then the same on the
quickstart's batch shape (256 rows, prompts of 24..32 tokens, responses of median 18 capped at 24;
64-row micro-batches against budgets of 2048 and 4096 tokens). Median of 3 calls after a
warm-up. `act MiB` is the memory of the activations that the largest training micro-batch saves
for its backward (tensors held by autograd, each storage counted once), beside `mb tokens`, the
token slots of that micro-batch (padding included): packed micro-batches stay under the budget
whatever the lengths, padded ones grow with the longest row.

CPU: the tiny quickstart model (`hybridflow.utils.tiny_model`, ~1 M parameters, fp32, 2048
positions) at TP1, torchrun with OMP_NUM_THREADS=1. CUDA (when present): a Qwen2.5-0.5B-shaped
random model (config only) in bf16 on one GPU, and MFU = achieved FLOPs / the GPU's dense bf16
peak, FLOPs per token as `hybridflow.utils.flops` counts them (6 N + 12 L h T for a training
step, a third of that for a forward pass).

Run: `python -m benchmarks megatron`. Results and the length distribution: docs/packing.md.
"""

import json
import sys
import tempfile
from pathlib import Path

from benchmarks._timing import median_seconds, run_torchrun

TITLE = "Megatron engine: padded vs packed tokens/s, log-normal response lengths (tiny model on CPU)"
REPEATS = 3
# Each shape: rows, prompt window and shortest prompt, response window, the log-normal response
# lengths, padded rows per micro-batch, packed token budgets (update, log-probs).
SHAPES = {
    "gsm8k-like": dict(
        batch=32, prompt=128, min_prompt=48, response=1024, median=150.0, sigma=1.0, micro=8,
        update_budget=4096, log_prob_budget=8192,
    ),
    # recipes/quickstart.yaml's batch: 256 rows of ~30-token prompts and <= 24-token responses,
    # 64-row micro-batches.
    "quickstart-like": dict(
        batch=256, prompt=32, min_prompt=24, response=24, median=18.0, sigma=0.25, micro=64,
        update_budget=2048, log_prob_budget=4096,
    ),
}  # fmt: skip
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


def run() -> list[dict]:
    import torch

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        from hybridflow.utils.tiny_model import make_tiny_model

        tiny = make_tiny_model(tmp / "tiny", max_position_embeddings=2048)
        rows = []
        for name, shape in SHAPES.items():
            print(f"{name}: {length_summary(response_lengths(shape))}", flush=True)
            rows += _launch(tiny, 1, "cpu", name, tmp)
        if torch.cuda.is_available():
            qwen = tmp / "qwen2.5-0.5b-shaped"
            qwen.mkdir()
            (qwen / "config.json").write_text(json.dumps(QWEN25_05B))
            rows += _launch(qwen, 1, "cuda", "gsm8k-like", tmp)
    return rows


def _launch(model_dir: Path, tp: int, device: str, shape: str, tmp: Path) -> list[dict]:
    result_file = tmp / f"{device}_tp{tp}_{shape}.json"
    what = f"megatron benchmark TP{tp} on {device}, {shape}"
    run_torchrun(__file__, tp, model_dir, tp, device, shape, result_file, what=what)
    return json.loads(result_file.read_text())


def response_lengths(shape: dict, seed: int = 0):
    """Log-normal response lengths (median `median`, log-std `sigma`), at least 1, capped."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    normal = torch.randn(shape["batch"], generator=gen)
    lengths = torch.exp(torch.log(torch.tensor(shape["median"])) + shape["sigma"] * normal)
    return lengths.round().clamp(1, shape["response"]).long()  # (B,)


def length_summary(lengths) -> str:
    """One line describing the distribution (what docs/packing.md quotes)."""
    import torch

    q = torch.quantile(lengths.float(), torch.tensor([0.5, 0.9, 0.99]))
    return (
        f"response lengths: median {q[0]:.0f}, p90 {q[1]:.0f}, p99 {q[2]:.0f}, max {int(lengths.max())}, "
        f"mean {lengths.float().mean():.0f}"
    )


def _batch(shape: dict, vocab_size: int):
    """Left-padded prompts + right-padded log-normal responses, with advantages."""
    import torch

    from hybridflow.protocol import DataProto

    gen = torch.Generator().manual_seed(1)
    b, p, r = shape["batch"], shape["prompt"], shape["response"]
    prompt_lens = torch.randint(shape["min_prompt"], p + 1, (b,), generator=gen)
    positions = torch.arange(p + r)
    real = (positions >= p - prompt_lens[:, None]) & (positions < p + response_lengths(shape)[:, None])
    attention_mask = real.long()  # (B, P+R)
    input_ids = torch.randint(3, vocab_size, (b, p + r), generator=gen) * attention_mask
    tensors = {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
        "responses": input_ids[:, p:],
        "response_mask": attention_mask[:, p:],
        "advantages": torch.randn(b, r, generator=gen) * attention_mask[:, p:],
    }
    return DataProto.from_dict(tensors=tensors, meta_info={"micro_batch_size": shape["micro"]})


def _activation_mib(actor, data, micro_batches) -> float:
    """MiB saved for backward by one training micro-batch (`micro_batches` selects it); weights
    that autograd keeps are not activations and are left out."""
    import torch

    from engines.megatron import forward

    weights = {p.untyped_storage().data_ptr() for chunk in actor.chunks for p in chunk.parameters()}
    storages: dict[int, int] = {}

    def keep(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in weights:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    def loss(logits, micro_batch):
        log_probs, _ = forward.response_log_probs(logits, micro_batch, 1.0, actor.vocab_size, "grad")
        return log_probs.sum(), {}

    for chunk in actor.chunks:
        chunk.train()
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        forward.run_micro_batches(actor.chunks, data, micro_batches, loss, forward_only=False)
    return sum(storages.values()) / 2**20


def _largest_micro_batch(data, mode: str, shape: dict):
    """(micro_batches argument running only the largest micro-batch, its token slots)."""
    from engines.megatron import forward

    lengths = data.batch["attention_mask"].sum(-1)
    if mode == "padded":
        rows, width = shape["micro"], data.batch["attention_mask"].shape[1]
        return rows, rows * width
    groups = forward.token_budget_groups(data, shape["update_budget"], "bench budget")
    largest = max(groups, key=lambda g: int(lengths[g].sum()))
    return [largest], int(lengths[largest].sum())


def _measure(actor, data, mode: str, shape: dict, sync) -> dict:
    """Timings of one mode and the activation memory of its largest training micro-batch."""
    packed = mode == "packed"
    actor.cfg.use_dynamic_bsz = packed
    actor.cfg.max_token_len_per_gpu = shape["update_budget"]
    data.meta_info["max_token_len"] = shape["log_prob_budget"] if packed else None
    micro, slots = _largest_micro_batch(data, mode, shape)
    piece = data if packed else data[list(range(shape["micro"]))]  # padded: one micro-batch
    return {
        "compute_log_prob": median_seconds(lambda: actor.compute_log_prob(data), REPEATS, sync),
        "update_policy": median_seconds(lambda: actor.update_policy(data), REPEATS, sync),
        "act MiB": _activation_mib(actor, piece, micro),
        "mb tokens": slots,
    }


def _rows(hf, device: str, shape: str, data, results: dict) -> list[dict]:
    import torch

    from hybridflow.utils.flops import peak_bf16_flops, train_flops_per_token

    peak = peak_bf16_flops(torch.cuda.get_device_name()) if device == "cuda" else None
    tokens = int(data.batch["attention_mask"].sum())
    flops = train_flops_per_token(hf, tokens / len(data))
    rows = []
    for op in ("compute_log_prob", "update_policy"):
        for mode in ("padded", "packed"):
            seconds = results[mode][op]
            op_flops = flops if op == "update_policy" else flops / 3
            rows.append({
                "shape": shape, "op": op, "mode": mode, "device": device, "tokens": tokens,
                "seconds": seconds, "tokens/s": tokens / seconds,
                "speedup": f"{results['padded'][op] / seconds:.2f}x",
                "mb tokens": results[mode]["mb tokens"] if op == "update_policy" else "-",
                "act MiB": results[mode]["act MiB"] if op == "update_policy" else "-",
                "MFU": f"{100 * op_flops * tokens / seconds / peak:.1f}%" if peak else "n/a",
            })  # fmt: skip
    return rows


def _worker(model_dir: Path, tp: int, device: str, shape_name: str, result_file: Path) -> None:
    """Runs on each torchrun rank; rank 0 writes the rows."""
    import torch
    import torch.distributed as dist

    from engines.megatron.actor import MegatronActor
    from engines.megatron.build import build_model
    from engines.megatron.config import ActorUpdateConfig, MegatronConfig, OptimConfig
    from engines.megatron.model import unwrap_model
    from engines.megatron.optimizer import build_optimizer
    from engines.megatron.parallel import init_megatron

    on_gpu = device == "cuda"
    cfg = MegatronConfig(tensor_model_parallel_size=tp, params_dtype="bfloat16" if on_gpu else "float32")
    init_megatron(cfg)
    chunks = build_model(model_dir, cfg, load_weights=not on_gpu)
    optimizer, scheduler = build_optimizer(chunks, OptimConfig(lr=1e-6), cfg)
    shape = SHAPES[shape_name]
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
    results = {mode: _measure(actor, data, mode, shape, sync) for mode in ("padded", "packed")}
    if dist.get_rank() == 0:
        result_file.write_text(json.dumps(_rows(hf, device, shape_name, data, results)))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    _worker(Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], Path(sys.argv[5]))
