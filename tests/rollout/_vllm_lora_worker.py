"""Worker for test_vllm_lora.py: adapter-only weight sync (`actor.lora.sync=adapters`) into a real
vLLM engine (CPU build) from a Megatron actor with LoRA adapters at TP 2, under torchrun on gloo
(2 ranks), with one vLLM engine at TP 2 over both ranks (external launcher). The engine starts
with random weights (`load_format: dummy`) and `enable_lora`, so every weight it generates with
came through a sync.

    python -m torch.distributed.run --nproc_per_node 2 tests/rollout/_vllm_lora_worker.py HF_DIR OUT_DIR

Checks, printing "OK <check>" on rank 0 after each:
  adapters-equal-merged  after a merged sync of nonzero adapters and then an adapter-only sync
                    of the same adapters, the engine's log-probs of fixed tokens agree within
                    1e-4 (fp32) and its greedy responses are the same;
  adapters-only     the next adapter-only sync sends exactly the adapter tensors (no base
                    weight) and vLLM holds one adapter, the new version;
  version-moves     after the adapters change, the adapter-only sync moves the log-probs, and
                    they equal a merged sync's of the changed adapters within 1e-4;
  unknown-module    an adapter on a module vLLM's model has no LoRA layer for is refused by
                    name (vLLM itself would skip it) and the engine's adapters stay as they were.
(every sync runs with verify_weight_sync: the engine's log-probs of fixed tokens equal the
actor's within 1e-3)
"""

import sys
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
from _vllm_worker import generate, make_prompts, say

from engines.megatron.build import build_model
from engines.megatron.config import LoraConfig, MegatronConfig
from engines.megatron.lora import adapter_names, adapter_tensor_shapes, iter_lora_tensors, load_lora_tensors
from engines.megatron.model import unwrap_model
from engines.megatron.parallel import init_megatron
from engines.rollout.config import RolloutConfig, SamplingConfig
from engines.rollout.sharding_manager import MegatronRolloutShardingManager
from engines.rollout.vllm_rollout import VLLMRolloutEngine
from engines.weight_sync.colocated import log_prob_probe

TOLERANCE = 1e-4
LORA = LoraConfig(rank=4, alpha=8.0, sync="adapters")


def nonzero_adapters(hf_config, scale: float) -> dict[str, torch.Tensor]:
    """Whole peft-named adapters with B != 0 (the initial B = 0 would leave the base model)."""
    gen = torch.Generator().manual_seed(0)
    shapes = [place[-1] for place in adapter_tensor_shapes(hf_config, LORA)]
    names = adapter_names(hf_config, LORA)
    return {
        name: scale * torch.randn(shape, generator=gen) for name, shape in zip(names, shapes, strict=True)
    }


def manager_for(chunks, hf_config, engine, cfg, sync: str) -> MegatronRolloutShardingManager:
    """A sharding manager that syncs the actor's adapters merged or alone (it reads actor.lora.sync
    from the model, as the trainer's does)."""
    model = unwrap_model(chunks[0])
    model.lora_config = replace(LORA, sync=sync)
    manager = MegatronRolloutShardingManager(chunks, hf_config, engine, cfg)
    model.lora_config = LORA
    return manager


def fixed_token_log_probs(engine: VLLMRolloutEngine, hf_config) -> torch.Tensor:
    return engine.score_log_probs(log_prob_probe(hf_config.vocab_size).batch["input_ids"].tolist())


def greedy_and_log_probs(manager, engine, hf_config) -> tuple[torch.Tensor, torch.Tensor]:
    responses = generate(manager, engine, make_prompts(validate=True)).batch["responses"]
    return responses, fixed_token_log_probs(engine, hf_config)


def check_adapters_only(manager, chunks, engine) -> None:
    sent = dict(iter_lora_tensors(chunks))
    stats = manager.last_sync
    assert stats.tensors == len(sent), (stats.tensors, len(sent))
    assert stats.bytes == sum(t.numel() * t.element_size() for t in sent.values()), stats
    loaded = engine.llm.collective_rpc(lambda worker: worker.model_runner.list_loras())
    assert loaded == [{engine.adapter.version}], loaded
    say(f"adapters-only ({stats.tensors} tensors, {stats.bytes} bytes, adapter id {engine.adapter.version})")


def check_unknown_module_is_refused(engine: VLLMRolloutEngine, manager) -> None:
    tensors = {
        "base_model.model.model.layers.0.self_attn.rotary.lora_A.weight": torch.ones(4, 128),
        "base_model.model.model.layers.0.self_attn.rotary.lora_B.weight": torch.ones(128, 4),
    }

    def loaded() -> list:
        return engine.llm.collective_rpc(lambda worker: worker.model_runner.list_loras())

    version, before = engine.adapter.version, loaded()
    try:
        engine.load_adapter(tensors, manager.weights.adapter_config)
    except ValueError as err:
        assert "self_attn.rotary" in str(err) and "no LoRA layer" in str(err), err
    else:
        raise AssertionError("an adapter on an unknown module was loaded")
    assert engine.adapter.version == version and loaded() == before, (version, before, loaded())
    say("unknown-module")


def main(hf_dir: Path, out_dir: Path) -> None:
    megatron_cfg = MegatronConfig(tensor_model_parallel_size=2)
    init_megatron(megatron_cfg)
    chunks = build_model(hf_dir, megatron_cfg, for_training=False, lora=LORA)
    hf_config = unwrap_model(chunks[0]).hf_config
    load_lora_tensors(chunks, nonzero_adapters(hf_config, scale=0.1))
    cfg = RolloutConfig(
        name="vllm",
        load_format="dummy",
        response_length=16,
        val_sampling=SamplingConfig(do_sample=False, temperature=0.0),
        verify_weight_sync=True,
        tensor_model_parallel_size=2,
    )
    engine = VLLMRolloutEngine(hf_dir, cfg, lora_rank=LORA.rank)
    merged = manager_for(chunks, hf_config, engine, cfg, "merged")
    adapters = manager_for(chunks, hf_config, engine, cfg, "adapters")

    greedy_merged, lp_merged = greedy_and_log_probs(merged, engine, hf_config)
    greedy_adapter, lp_adapter = greedy_and_log_probs(adapters, engine, hf_config)
    worst = float((lp_merged - lp_adapter).abs().max())
    assert worst < TOLERANCE, f"adapter-only vs merged sync: max |log-prob difference| {worst:.2e}"
    assert torch.equal(greedy_merged, greedy_adapter), "greedy responses differ"
    say(f"adapters-equal-merged (max |difference| {worst:.1e})")

    load_lora_tensors(chunks, nonzero_adapters(hf_config, scale=0.2))
    _, lp_v2 = greedy_and_log_probs(adapters, engine, hf_config)
    check_adapters_only(adapters, chunks, engine)
    moved = float((lp_v2 - lp_adapter).abs().max())
    assert moved > 0.1, f"changed adapters moved the engine's log-probs by only {moved:.2e}"
    _, lp_merged_v2 = greedy_and_log_probs(merged, engine, hf_config)
    worst = float((lp_merged_v2 - lp_v2).abs().max())
    assert worst < TOLERANCE, f"second adapter-only sync vs merged sync: max |difference| {worst:.2e}"
    say(f"version-moves (log-probs moved by up to {moved:.2f}; vs merged {worst:.1e})")
    check_unknown_module_is_refused(engine, adapters)
    dist.barrier()
    engine.shutdown()  # vLLM's teardown destroys the process group too


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
