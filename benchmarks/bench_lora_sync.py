"""LoRA weight sync into vLLM (CPU build): merged against adapter-only (`actor.lora.sync`).

The 76M Qwen2 shape of bench_vllm (hidden 768, 12 layers, fp32) held by a Megatron actor at TP1
(1 process, torchrun) with rank-16 adapters on every linear (B nonzero), synced into one vLLM
engine started with `enable_lora` by `MegatronRolloutShardingManager.sync_weights`: merged
(every HF tensor, base + scale * B A, through the layerwise reload) and adapter-only (after the
first sync, which also sends the base weights once: only A and B, loaded as a vLLM LoRA adapter).
Median of 3 syncs after a warm-up each; bytes are what the actor hands the engine per sync.

Run: `python -m benchmarks lora_sync`.
"""

import json
import os
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

from benchmarks._timing import median_seconds, run_torchrun
from benchmarks.bench_vllm import SHAPE_76M, _make_model

TITLE = "LoRA weight sync into vLLM: merged vs adapter-only (76M shape, rank 16, actor TP1)"
REPEATS = 3
RANK = 16


def run() -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model_dir = _make_model(tmp / "m76", **SHAPE_76M)
        result = tmp / "lora_sync.json"
        run_torchrun(__file__, 1, model_dir, result, what="LoRA sync benchmark")
        return json.loads(result.read_text())


def _nonzero_adapters(hf_config, lora) -> dict:
    """Whole adapters with B != 0, as after some training (the initial B = 0)."""
    import torch

    from engines.megatron.lora import adapter_names, adapter_tensor_shapes

    gen = torch.Generator().manual_seed(0)
    shapes = [place[-1] for place in adapter_tensor_shapes(hf_config, lora)]
    return {
        name: 0.01 * torch.randn(shape, generator=gen)
        for name, shape in zip(adapter_names(hf_config, lora), shapes, strict=True)
    }


def _sync_worker(model_dir: Path, result_file: Path) -> None:
    """Runs on the torchrun rank: both syncs into one engine, merged first (an adapter-only
    manager's first sync sends the base weights, which its warm-up call pays)."""
    from engines.megatron.config import LoraConfig, MegatronConfig
    from engines.megatron.lora import load_lora_tensors
    from engines.megatron.model import build_model, unwrap_model
    from engines.megatron.parallel import init_megatron
    from engines.rollout.config import RolloutConfig
    from engines.rollout.sharding_manager import MegatronRolloutShardingManager
    from engines.rollout.vllm_rollout import VLLMRolloutEngine

    megatron_cfg = MegatronConfig()
    init_megatron(megatron_cfg)
    lora = LoraConfig(rank=RANK, alpha=2.0 * RANK)
    chunks = build_model(model_dir, megatron_cfg, for_training=False, lora=lora)
    model = unwrap_model(chunks[0])
    load_lora_tensors(chunks, _nonzero_adapters(model.hf_config, lora))
    cfg = RolloutConfig(name="vllm", free_cache_engine=False)
    engine = VLLMRolloutEngine(model_dir, cfg, lora_rank=RANK)
    rows = []
    for sync in ("merged", "adapters"):
        model.lora_config = replace(lora, sync=sync)  # what the manager reads (actor.lora.sync)
        manager = MegatronRolloutShardingManager(chunks, model.hf_config, engine, cfg)
        seconds = median_seconds(manager.sync_weights, REPEATS)
        rows.append((sync, manager.last_sync.tensors, manager.last_sync.bytes, seconds))
    result_file.write_text(json.dumps(_rows(rows)))
    engine.shutdown()  # also ends the process group (vLLM's teardown)


def _rows(measured: list[tuple[str, int, int, float]]) -> list[dict]:
    (_, _, merged_bytes, merged_seconds) = measured[0]
    rows = []
    for sync, tensors, nbytes, seconds in measured:
        speedup = merged_seconds / seconds
        rows.append(
            {
                "case": f"actor.lora.sync={sync}, actor TP1 -> vllm",
                "size": f"{tensors} tensors, {nbytes / 1e6:.2f} MB",
                "seconds": seconds,
                "vs merged": f"{nbytes / merged_bytes:.2%} of the bytes, {speedup:.1f}x as fast",
            }
        )
    return rows


if __name__ == "__main__":
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    _sync_worker(Path(sys.argv[1]), Path(sys.argv[2]))
