"""torchrun worker for test_train_parity.py: PPO / critic / SFT updates and checkpoints at one layout.

    python -m torch.distributed.run --nproc_per_node N _train_parity.py ROOT TP PP TAG STEPS...

ROOT holds `hf/` (tiny checkpoint) and `batch.pt` (the global batch, written by the test). Each
STEP runs in order on this layout; rank 0 writes ROOT/TAG.pt with the exported HF tensors and
metrics of every step:
- `actor:<mode>`: a fresh actor, one `update_policy` call with loss_agg_mode <mode>.
- `critic`: a fresh critic, `compute_values` then one `update_critic` call.
- `sft`: a fresh actor, several `update_sft` steps on the batch (losses recorded).
- `save:<dir>`: the last actor's model + optimizer + scheduler to ROOT/<dir>, loaded back at this
  layout (the RNG path), then a second `update_policy` call (`after_save`).
- `load:<dir>`: a fresh actor and optimizer restored from ROOT/<dir>, exported (`loaded`), then a
  second `update_policy` call (`after_load`).
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from _train_settings import ACTOR_UPDATE, CRITIC_UPDATE, OPTIM, SFT_STEPS, TEMPERATURE

from engines.megatron.actor import MegatronActor
from engines.megatron.checkpoint import load_checkpoint, save_checkpoint
from engines.megatron.config import ActorUpdateConfig, MegatronConfig
from engines.megatron.critic import MegatronCritic
from engines.megatron.model import build_model, unwrap_model
from engines.megatron.offload import offload_model, offload_optimizer, reload_model, reload_optimizer
from engines.megatron.optimizer import build_optimizer
from engines.megatron.parallel import init_megatron, parallel_ranks
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


def build_actor(hf_dir, cfg, mode):
    chunks = build_model(hf_dir, cfg)
    optimizer, scheduler = build_optimizer(chunks, OPTIM, cfg)
    return MegatronActor(chunks, optimizer, scheduler, ActorUpdateConfig(**ACTOR_UPDATE, loss_agg_mode=mode))


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
            chunks = build_model(hf_dir, cfg, value_head=True)
            optimizer, scheduler = build_optimizer(chunks, OPTIM, cfg)
            critic = MegatronCritic(chunks, optimizer, scheduler, CRITIC_UPDATE)
            values = critic.compute_values(shard)
            values = None if values is None else values.batch["values"]
            metrics = critic.update_critic(shard)
            results[step] = {
                "weights": export(chunks),
                "metrics": last_stage_value(metrics),
                "values": last_stage_value(values),
            }
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
