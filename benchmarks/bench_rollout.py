"""Hybrid-engine costs on CPU: actor -> rollout weight sync, and hf-engine generation speed.

Weight sync: a ~100M-parameter Qwen2-shaped model (hidden 768, 12 layers, vocab 16,000; fp32,
random init, built locally) held by a Megatron-Core actor at TP2 on 2 gloo processes (torchrun),
synced into each rank's hf engine by `MegatronRolloutShardingManager.load_weights` (TP all-gather,
HF renaming, QKV / gate-up split, 512 MiB buckets, in-place copy). GB/s counts the HF bytes
loaded into one engine. Baseline: a plain in-place copy of the same tensors into the same engine
parameters (the memory-bandwidth floor of the last step). Also timed with `verify_weight_sync`
(BLAKE2b of every tensor on both sides). Median of 3 syncs after a warm-up.

Generation: the tiny quickstart model (`hybridflow.utils.tiny_model`, ~0.8M parameters), hf
engine, batch 64, 32-token prompts, 128 new tokens sampled at temperature 1 (EOS can end rows
early; tokens/s counts generated tokens, EOS included). Median of 3 calls after a warm-up.

Run: `python -m benchmarks rollout`.
"""

import json
import statistics
import sys
import tempfile
from pathlib import Path

from benchmarks._timing import median_seconds, run_torchrun

TITLE = "Rollout: weight sync (actor TP2 -> hf engine, ~100M params, CPU) and hf generation"
REPEATS = 3
SYNC_MODEL = dict(
    hidden_size=768,
    num_hidden_layers=12,
    num_attention_heads=12,
    num_key_value_heads=4,
    intermediate_size=2048,
    vocab_size=16_000,
)
GEN_BATCH, GEN_PROMPT, GEN_NEW = 64, 32, 128


def run() -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        sync = _run_sync_benchmark(Path(tmp))
        generation = _generation_row(Path(tmp) / "tiny")
    return [*sync, generation]


# ---------------------------------------------------------------- weight sync (torchrun, 2 ranks)


def _run_sync_benchmark(tmp: Path) -> list[dict]:
    from transformers import Qwen2Config

    model_dir = tmp / "sync_model"
    config = Qwen2Config(**SYNC_MODEL, architectures=["Qwen2ForCausalLM"], eos_token_id=1, pad_token_id=0)
    config.save_pretrained(model_dir)
    result_file = tmp / "sync.json"
    run_torchrun(__file__, 2, model_dir, result_file, what="sync benchmark")
    return json.loads(result_file.read_text())


def _sync_worker(model_dir: Path, result_file: Path) -> None:
    """Runs on each torchrun rank; rank 0 writes the rows."""
    import torch
    import torch.distributed as dist

    from engines.megatron.build import build_model
    from engines.megatron.config import MegatronConfig
    from engines.megatron.model import unwrap_model
    from engines.megatron.parallel import init_megatron
    from engines.megatron.weights import iter_hf_tensors
    from engines.rollout.config import RolloutConfig
    from engines.rollout.hf_rollout import HFRolloutEngine
    from engines.rollout.sharding_manager import MegatronRolloutShardingManager

    megatron_cfg = MegatronConfig(tensor_model_parallel_size=2)
    init_megatron(megatron_cfg)
    chunks = build_model(model_dir, megatron_cfg, load_weights=False, for_training=False)
    hf_config = unwrap_model(chunks[0]).hf_config

    def stream_only():
        for _ in iter_hf_tensors(chunks, hf_config):
            pass

    stream_seconds = median_seconds(stream_only, REPEATS)
    rows = []
    for verify in (False, True):
        cfg = RolloutConfig(verify_weight_sync=verify, free_cache_engine=False)
        engine = HFRolloutEngine(model_dir, cfg, device="cpu")
        manager = MegatronRolloutShardingManager(chunks, hf_config, engine, cfg)
        seconds = median_seconds(manager.load_weights, REPEATS)
        nbytes = manager.last_sync.bytes
        label = "weight sync, verify_weight_sync" if verify else "weight sync"
        rows.append(_row(label, nbytes, seconds))
    params = [p for _, p in engine.model.named_parameters()]
    sources = [p.detach().clone() for p in params]

    @torch.no_grad()
    def plain_copy():
        for param, source in zip(params, sources, strict=True):
            param.copy_(source)

    rows.insert(0, _row("actor stream only (iter_hf_tensors)", nbytes, stream_seconds))
    rows.append(_row("plain copy of the same bytes", nbytes, median_seconds(plain_copy, REPEATS)))
    if dist.get_rank() == 0:
        result_file.write_text(json.dumps(rows))
    dist.barrier()
    dist.destroy_process_group()


def _row(case: str, nbytes: int, seconds: float) -> dict:
    return {
        "case": case,
        "size": f"{nbytes / 1e6:.0f} MB",
        "seconds": seconds,
        "throughput": f"{nbytes / seconds / 1e9:.2f} GB/s",
    }


# ---------------------------------------------------------------- generation (this process)


def _generation_row(model_dir: Path) -> dict:
    import torch

    from engines.rollout.config import RolloutConfig, SamplingConfig
    from engines.rollout.hf_rollout import HFRolloutEngine
    from hybridflow.protocol import DataProto
    from hybridflow.utils.tiny_model import make_tiny_model

    torch.set_num_threads(1)
    make_tiny_model(model_dir)
    cfg = RolloutConfig(load_format="auto", response_length=GEN_NEW, sampling=SamplingConfig(temperature=1.0))
    engine = HFRolloutEngine(model_dir, cfg, device="cpu")
    ids = torch.randint(10, 100, (GEN_BATCH, GEN_PROMPT), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    positions = mask.cumsum(-1) - 1
    prompts = DataProto.from_dict({"input_ids": ids, "attention_mask": mask, "position_ids": positions})
    tokens = []

    def generate():
        tokens.append(int(engine.generate_sequences(prompts).batch["response_mask"].sum()))

    seconds = median_seconds(generate, REPEATS)
    generated = statistics.median(tokens)
    params = sum(p.numel() for p in engine.model.parameters())
    return {
        "case": f"hf generate, batch {GEN_BATCH}, {GEN_NEW} new tokens",
        "size": f"{params / 1e6:.1f}M params",
        "seconds": seconds,
        "throughput": f"{generated / seconds:.0f} tokens/s",
    }


if __name__ == "__main__":
    _sync_worker(Path(sys.argv[1]), Path(sys.argv[2]))
