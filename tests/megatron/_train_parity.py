"""torchrun worker for test_train_parity.py: PPO / critic / SFT updates and checkpoints at one layout.

    python -m torch.distributed.run --nproc_per_node N _train_parity.py ROOT TP PP TAG STEPS...

ROOT holds `hf/` (tiny checkpoint), `batch.pt` (the global batch, written by the test) and
`heavy.pt` (a batch with heavy-tailed response lengths, for packing). Each STEP runs in order on
this layout; rank 0 writes ROOT/TAG.pt with the exported HF tensors and metrics of every step:
- `actor:<mode>`: a fresh actor, one `update_policy` call with loss_agg_mode <mode>.
- `critic`: a fresh critic, `compute_values` then one `update_critic` call.
- `sft`: a fresh actor, several `update_sft` steps on the batch (losses recorded).
- `save:<dir>`: the last actor's model + optimizer + scheduler to ROOT/<dir>, loaded back at this
  layout (the RNG path), then a second `update_policy` call (`after_save`).
- `load:<dir>`: a fresh actor and optimizer restored from ROOT/<dir>, exported (`loaded`), then a
  second `update_policy` call (`after_load`).
- `heavy-actor:<mode>:<padded|packed>`, `heavy-critic:<padded|packed>`: as `actor` / `critic` on
  the heavy batch, with padded fixed micro-batches or packed token-budget ones (`PACKED_BUDGET`),
  and `HEAVY_OPTIM`.
- `packing`: on the heavy batch, padded and packed side by side in this process: log-probs and
  entropies, values, reward-model scores, and the gradients of a token-mean loss (log-prob NLL
  minus an entropy bonus) through the schedule (`padded` / `packed` entries).
"""

import dataclasses
import sys
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from _train_settings import (
    ACTOR_UPDATE,
    CRITIC_UPDATE,
    HEAVY_OPTIM,
    OPTIM,
    PACKED_BUDGET,
    SFT_STEPS,
    TEMPERATURE,
)

from engines.megatron import forward
from engines.megatron.actor import MegatronActor
from engines.megatron.build import build_model
from engines.megatron.checkpoint import load_checkpoint, save_checkpoint
from engines.megatron.config import ActorUpdateConfig, MegatronConfig
from engines.megatron.critic import MegatronCritic
from engines.megatron.model import unwrap_model
from engines.megatron.offload import offload_model, offload_optimizer, reload_model, reload_optimizer
from engines.megatron.optimizer import build_optimizer
from engines.megatron.parallel import init_megatron, parallel_ranks
from engines.megatron.training import global_counts, loss_scale
from engines.megatron.weights import iter_hf_tensors
from hybridflow.protocol import DataProto


def export(chunks) -> dict[str, torch.Tensor]:
    return dict(iter_hf_tensors(chunks, unwrap_model(chunks[0]).hf_config))


def last_stage_value(value):
    """The value held by the last pipeline stage's first rank, on every rank."""
    ranks = parallel_ranks()
    holder = ranks.pp == ranks.pp_size - 1 and ranks.tp == 0 and ranks.dp == 0
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value if holder else None)
    return next(v for v in gathered if v is not None)


def packing_settings(packed: bool) -> dict:
    return {"use_dynamic_bsz": packed, "max_token_len_per_gpu": PACKED_BUDGET}


def build_actor(hf_dir, cfg, mode, packed=False, optim=OPTIM):
    chunks = build_model(hf_dir, cfg)
    optimizer, scheduler = build_optimizer(chunks, optim, cfg)
    update_cfg = ActorUpdateConfig(**ACTOR_UPDATE, loss_agg_mode=mode, **packing_settings(packed))
    return MegatronActor(chunks, optimizer, scheduler, update_cfg)


def run_critic(hf_dir, cfg, shard, packed=False, optim=OPTIM) -> dict:
    chunks = build_model(hf_dir, cfg, value_head=True)
    optimizer, scheduler = build_optimizer(chunks, optim, cfg)
    update_cfg = dataclasses.replace(CRITIC_UPDATE, **packing_settings(packed))
    critic = MegatronCritic(chunks, optimizer, scheduler, update_cfg)
    values = critic.compute_values(shard)
    values = None if values is None else values.batch["values"]
    metrics = critic.update_critic(shard)
    values = last_stage_value(values)
    return {"weights": export(chunks), "metrics": last_stage_value(metrics), "values": values}


def nll_entropy_loss(total_tokens, num_micro_batches, vocab_size, logits, micro_batch):
    """Token-mean NLL minus 0.1 x token-mean entropy over the whole batch (the schedule's 1/M undone)."""
    log_probs, entropy = forward.response_log_probs(logits, micro_batch, TEMPERATURE, vocab_size, "grad")
    mask = micro_batch["response_mask"]
    loss = -((log_probs + 0.1 * entropy) * mask).sum() / total_tokens * num_micro_batches
    return loss, {"loss": loss.detach()}


def gradients(hf_dir, cfg, shard, micro_batches) -> dict[str, torch.Tensor]:
    """HF-named gradients of `nll_entropy_loss` over `shard` (averaged over data-parallel ranks)."""
    chunks = build_model(hf_dir, cfg)
    model = unwrap_model(chunks[0])
    tokens, _ = global_counts(shard.batch["response_mask"])
    count = len(shard) // micro_batches if isinstance(micro_batches, int) else len(micro_batches)
    loss = partial(nll_entropy_loss, tokens, loss_scale(count), model.hf_config.vocab_size)
    forward.run_micro_batches(chunks, shard, micro_batches, loss, forward_only=False)
    with torch.no_grad():  # the weight mapping is linear: export the gradients through it
        for param in model.parameters():
            param.copy_(param.main_grad)
    return export(chunks)


def packing_side_by_side(hf_dir, cfg, shard) -> dict:
    """Padded and packed results of the same forward and backward passes on `shard`."""
    groups = forward.token_budget_groups(shard, PACKED_BUDGET, "test budget")
    chunks = build_model(hf_dir, cfg, for_training=False)
    scorer = MegatronCritic(build_model(hf_dir, cfg, value_head=True, for_training=False))
    results = {}
    for name, budget, micro in (("padded", None, 2), ("packed", PACKED_BUDGET, groups)):
        data = DataProto.from_dict(
            tensors=dict(shard.batch.items()), meta_info={"micro_batch_size": 2, "max_token_len": budget}
        )
        log_probs = forward.compute_log_prob(chunks, data, 2, TEMPERATURE, max_token_len=budget)
        values, scores = scorer.compute_values(data), scorer.compute_sequence_scores(data)
        results[name] = {
            "log_probs": last_stage_value(None if log_probs is None else log_probs.batch["old_log_probs"]),
            "entropys": last_stage_value(None if log_probs is None else log_probs.batch["entropys"]),
            "values": last_stage_value(None if values is None else values.batch["values"]),
            "scores": last_stage_value(None if scores is None else scores.batch["scores"]),
            "grads": gradients(hf_dir, cfg, shard, micro),
        }
    results["num_micro_batches"] = len(groups)
    return results


def round_trip_offload(actor) -> None:
    """Exercise offload between phases (a no-op on CPU; the real path needs CUDA)."""
    offload_model(actor.chunks)
    offload_optimizer(actor.optimizer)
    reload_model(actor.chunks)
    reload_optimizer(actor.optimizer)


def main(root: Path, tp: int, pp: int, tag: str, steps: list[str]) -> None:
    cfg = MegatronConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, seed=7)
    ranks = init_megatron(cfg)
    hf_dir = root / "hf"
    full = DataProto.from_dict(tensors=torch.load(root / "batch.pt"), meta_info={"temperature": TEMPERATURE})
    shard = full.chunk(ranks.dp_size)[ranks.dp]
    heavy = DataProto.from_dict(tensors=torch.load(root / "heavy.pt"), meta_info={"temperature": TEMPERATURE})
    heavy_shard = heavy.chunk(ranks.dp_size)[ranks.dp]
    results: dict = {}
    actor = None
    for step in steps:
        kind, _, arg = step.partition(":")
        if kind == "actor":
            actor = build_actor(hf_dir, cfg, arg)
            metrics = actor.update_policy(shard)
            results[step] = {"weights": export(actor.chunks), "metrics": last_stage_value(metrics)}
            round_trip_offload(actor)
        elif kind == "critic":
            results[step] = run_critic(hf_dir, cfg, shard)
        elif kind == "heavy-actor":
            mode, _, layout = arg.partition(":")
            heavy_actor = build_actor(hf_dir, cfg, mode, packed=layout == "packed", optim=HEAVY_OPTIM)
            metrics = heavy_actor.update_policy(heavy_shard)
            results[step] = {"weights": export(heavy_actor.chunks), "metrics": last_stage_value(metrics)}
        elif kind == "heavy-critic":
            results[step] = run_critic(hf_dir, cfg, heavy_shard, packed=arg == "packed", optim=HEAVY_OPTIM)
        elif kind == "packing":
            results[step] = packing_side_by_side(hf_dir, cfg, heavy_shard)
        elif kind == "sft":
            sft_actor = build_actor(hf_dir, cfg, "token-mean")
            losses = [sft_actor.update_sft(shard) for _ in range(SFT_STEPS)]
            results[step] = {"metrics": last_stage_value(losses)}
        elif kind == "save":
            save_checkpoint(actor.chunks, actor.optimizer, actor.scheduler, root / arg)
            load_checkpoint(actor.chunks, actor.optimizer, actor.scheduler, root / arg)
            metrics = actor.update_policy(shard)
            results["after_save"] = {"weights": export(actor.chunks), "metrics": last_stage_value(metrics)}
        elif kind == "load":
            actor = build_actor(hf_dir, cfg, "token-mean")
            load_checkpoint(actor.chunks, actor.optimizer, actor.scheduler, root / arg)
            results["loaded"] = {"weights": export(actor.chunks)}
            metrics = actor.update_policy(shard)
            results["after_load"] = {"weights": export(actor.chunks), "metrics": last_stage_value(metrics)}
        else:
            raise ValueError(f"unknown step {step!r}")
    if dist.get_rank() == 0:
        torch.save(results, root / f"{tag}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5:])
