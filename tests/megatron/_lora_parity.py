"""torchrun worker for test_lora_parity.py: the Megatron model with LoRA adapters at one layout.

    python -m torch.distributed.run --nproc_per_node N _lora_parity.py ROOT TP PP TAG

ROOT holds `hf/` (tiny checkpoint), `adapters.pt` (peft-named adapter tensors, nonzero) and
`batch.pt`; `lora.json` the LoraConfig fields. Rank 0 writes ROOT/TAG.pt with:
- `initial`: the adapters as `build_model` initialised them (exported before loading adapters.pt);
- `moe_logits`: logits of the Qwen3-MoE model in ROOT/moe_hf with the attention adapters in
  `moe_adapters.pt` (`moe_lora.json`);
- `logits` / `base_logits`: full-vocabulary logits (B, T, V) with the adapters on / disabled;
  `dropout_logits` in train mode with adapter dropout from a fixed generator state;
- `exported`: `iter_lora_tensors` after loading `adapters.pt` (the round trip);
- `grads`: the adapters' gradients of a token-mean NLL through Megatron's schedule and DDP,
  `grad_norm` of the optimizer step that follows, `stepped` the adapters after it;
- `base_moved`: base tensors the step changed (must be none), `trainable` / `optimized`: the
  number of elements with requires_grad on this rank's model and in the optimizer's groups;
- `merged`: the merged weight stream (`iter_hf_tensors`) with the loaded adapters, and
  `merged_after_step` / `stepped` the stream and the adapters after the step.
ROOT/peft_TAG is the loaded adapters saved as a peft adapter directory. The SAVING layout then
saves its stepped actor (model, optimizer, LR schedule) to ROOT/checkpoint and records the
adapters after one more step (`next_step`); the others restore a fresh actor from that checkpoint
(`resumed`: `loaded` adapters, and `next_step` after one more step).
"""

import dataclasses
import json
import sys
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from _model_parity_worker import nll_loss
from _train_parity import last_stage_value
from _train_settings import OPTIM
from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

from engines.megatron.build import build_model
from engines.megatron.checkpoint import load_checkpoint, save_checkpoint
from engines.megatron.config import LoraConfig, MegatronConfig
from engines.megatron.forward import run_micro_batches
from engines.megatron.lora import (
    adapters,
    adapters_disabled,
    iter_lora_tensors,
    load_lora_tensors,
    parameter_counts,
    save_peft_adapter,
)
from engines.megatron.model import unwrap_model
from engines.megatron.optimizer import build_optimizer
from engines.megatron.parallel import init_megatron
from engines.megatron.training import optimizer_step, train_step
from engines.megatron.weights import iter_hf_tensors
from hybridflow.protocol import DataProto

MICRO_BATCH = 2
OPTIM_CONSTANT = dataclasses.replace(OPTIM, lr_decay_style="constant")


SAVING = "tp2"  # runs first


def full_logits(chunks, data, vocab_size):
    """(B, T, V) logits on the last stage (None elsewhere), TP shards gathered."""

    def gather(output, micro_batch):
        return output.new_zeros(()), gather_from_tensor_model_parallel_region(output)

    results = run_micro_batches(chunks, data, MICRO_BATCH, gather, forward_only=True)
    return torch.cat(results)[..., :vocab_size] if results else None


def moe_attention_logits(root: Path, cfg, data, vocab_size):
    """Logits of the mixture-of-experts model (ROOT/moe_hf) with attention adapters, in eval mode
    (Megatron-Core's MoE layer refuses train mode at TP > 1 without sequence parallelism)."""
    lora = LoraConfig(**json.loads((root / "moe_lora.json").read_text()))
    chunks = build_model(root / "moe_hf", cfg, for_training=False, lora=lora)
    load_lora_tensors(chunks, torch.load(root / "moe_adapters.pt"))
    for chunk in chunks:
        chunk.eval()
    return full_logits(chunks, data, vocab_size)


def dropout_logits(chunks, data, vocab_size):
    """Logits in train mode with adapter dropout 0.3, from a fixed generator state."""
    for _, adapter in adapters(chunks):
        adapter.dropout = 0.3
    for chunk in chunks:
        chunk.train()
    torch.manual_seed(123)
    logits = full_logits(chunks, data, vocab_size)
    for _, adapter in adapters(chunks):
        adapter.dropout = 0.0
    return logits


def adapter_gradients(chunks) -> dict[str, torch.Tensor]:
    """The adapters' main_grads, exported through the same gather as the adapters (it is linear)."""
    model = unwrap_model(chunks[0])
    saved = {}
    with torch.no_grad():
        for param in model.parameters():
            if param.requires_grad:
                saved[param] = param.detach().clone()
                param.copy_(param.main_grad)
    grads = dict(iter_lora_tensors(chunks))
    with torch.no_grad():
        for param, value in saved.items():
            param.copy_(value)
    return grads


def base_params(model):
    return [(n, p) for n, p in model.named_parameters() if ".lora." not in n]


def train_one_step(hf_dir, cfg, lora, tensors, data, total_tokens, vocab_size) -> dict:
    chunks = build_model(hf_dir, cfg, lora=lora)
    load_lora_tensors(chunks, tensors)
    model = unwrap_model(chunks[0])
    base_before = {n: p.detach().clone() for n, p in base_params(model)}
    optimizer, scheduler = build_optimizer(chunks, OPTIM_CONSTANT, cfg)
    loss = partial(nll_loss, vocab_size, total_tokens, len(data) // MICRO_BATCH)
    for chunk in chunks:  # train_step's parts, to read the gradients before clipping scales them
        chunk.train()
        chunk.zero_grad_buffer()
    run_micro_batches(chunks, data, MICRO_BATCH, loss, forward_only=False)
    grads = adapter_gradients(chunks)
    metrics = optimizer_step(optimizer, scheduler)
    optimized = {id(p) for group in optimizer.param_groups for p in group["params"]}
    trainable = [p for p in model.parameters() if p.requires_grad]
    result = {
        "grads": grads,
        "grad_norm": metrics["grad_norm"],
        "stepped": dict(iter_lora_tensors(chunks)),
        "base_moved": [n for n, p in base_params(model) if not p.equal(base_before[n])],
        "base_with_grad": [n for n, p in base_params(model) if p.requires_grad or hasattr(p, "main_grad")],
        "optimizer_is_adapters": optimized == {id(p) for p in trainable},
        "trainable": sum(p.numel() for p in trainable),
        "merged_after_step": dict(iter_hf_tensors(chunks, model.hf_config)),
        "counts": parameter_counts(chunks, optimizer),
    }
    return result, (chunks, optimizer, scheduler), loss


def next_step(actor, data, loss) -> dict[str, torch.Tensor]:
    """The adapters after one more step of `actor` (chunks, optimizer, scheduler) on `data`."""
    chunks, optimizer, scheduler = actor
    train_step(chunks, optimizer, scheduler, data, MICRO_BATCH, loss)
    return dict(iter_lora_tensors(chunks))


def resumed(hf_dir, cfg, lora, checkpoint, data, loss) -> dict:
    """A fresh LoRA actor restored from `checkpoint`: its adapters, then after one more step."""
    chunks = build_model(hf_dir, cfg, lora=lora)
    optimizer, scheduler = build_optimizer(chunks, OPTIM_CONSTANT, cfg)
    load_checkpoint(chunks, optimizer, scheduler, checkpoint)
    loaded = dict(iter_lora_tensors(chunks))
    return {"loaded": loaded, "next_step": next_step((chunks, optimizer, scheduler), data, loss)}


def main(root: Path, tp: int, pp: int, tag: str) -> None:
    torch.use_deterministic_algorithms(True)
    cfg = MegatronConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, seed=7)
    init_megatron(cfg)
    lora = LoraConfig(**json.loads((root / "lora.json").read_text()))
    hf_dir, tensors = root / "hf", torch.load(root / "adapters.pt")
    batch = torch.load(root / "batch.pt")
    data = DataProto.from_dict(tensors=batch)
    chunks = build_model(hf_dir, cfg, for_training=False, lora=lora)
    vocab_size = unwrap_model(chunks[0]).hf_config.vocab_size
    initial = dict(iter_lora_tensors(chunks))
    load_lora_tensors(chunks, tensors)
    results = {"initial": initial, "logits": last_stage_value(full_logits(chunks, data, vocab_size))}
    with adapters_disabled(chunks):
        results["base_logits"] = last_stage_value(full_logits(chunks, data, vocab_size))
    results["dropout_logits"] = last_stage_value(dropout_logits(chunks, data, vocab_size))
    results["exported"] = dict(iter_lora_tensors(chunks))
    results["merged"] = dict(iter_hf_tensors(chunks, unwrap_model(chunks[0]).hf_config))
    save_peft_adapter(chunks, root / f"peft_{tag}")
    results["moe_logits"] = last_stage_value(moe_attention_logits(root, cfg, data, vocab_size))
    total_tokens = batch["response_mask"].sum().item()
    step, actor, loss = train_one_step(hf_dir, cfg, lora, tensors, data, total_tokens, vocab_size)
    if tag == SAVING:
        save_checkpoint(*actor, root / "checkpoint")
        results["next_step"] = next_step(actor, data, loss)
    else:
        results["resumed"] = resumed(hf_dir, cfg, lora, root / "checkpoint", data, loss)
    gathered = [None] * dist.get_world_size()
    own = ("base_moved", "base_with_grad", "optimizer_is_adapters", "trainable", "counts")
    dist.all_gather_object(gathered, {k: step.pop(k) for k in own})
    results.update(step, per_rank=gathered)
    if dist.get_rank() == 0:
        torch.save(results, root / f"{tag}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
