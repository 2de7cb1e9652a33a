"""torchrun worker: the LLaVA actor trains (engines/megatron/build.py's `build_vlm_model`, the
optimizer, `MegatronActor.update_sft`) on the parity worker's left-padded image batch, at the TP
size of the launch.

    torchrun --nproc_per_node 2 tests/megatron/_vlm_train_worker.py --hf-dir D --out-dir O

On every rank it checks:
  1. with the vision tower frozen (the default), five SFT steps lower the loss, the tower's
     parameters stay bit for bit, and every parameter of the projector and the language model
     moves (on some TP rank);
  2. the trained model, exported in the Hugging Face format (what the weight sync sends), gives
     transformers the actor's response log-probs on every row within 1e-5;
  3. the weight sync (the hybrid engine's sharding manager, verify_weight_sync on) puts the trained
     actor into an `hf` engine started from random weights: every engine tensor, tower and
     projector included, equals the export bit for bit, and greedy generation from the image
     prompts through the manager (each rank a slice, gathered) equals transformers' on the export,
     row by row;
  4. with `train_vision_tower=True`, one step moves the tower too.
Prints "VLM TRAIN OK tp=.. rank=.. losses=.." when every check passed.
"""

import os
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from _vlm_parity_worker import batch_rows, check_padded_log_probs, padded_batch, parse_dirs
from megatron.core import parallel_state
from safetensors.torch import load_file

from engines.megatron.actor import MegatronActor
from engines.megatron.build import build_vlm_model
from engines.megatron.config import ActorUpdateConfig, MegatronConfig, OptimConfig
from engines.megatron.model import unwrap_model
from engines.megatron.optimizer import build_optimizer
from engines.megatron.parallel import init_megatron
from engines.megatron.vlm_weights import save_vlm_hf_checkpoint
from engines.rollout.config import RolloutConfig, SamplingConfig
from engines.rollout.hf_rollout import HFRolloutEngine, checkpoint_tensors
from engines.rollout.sharding_manager import MegatronRolloutShardingManager
from hybridflow.protocol import PIXEL_VALUES_KEY, DataProto

STEPS = 5
MAX_NEW = 6
OPTIM = OptimConfig(lr=2e-3, weight_decay=0.0)  # the loss falls, the log-probs stay far from 0


def build_actor(hf_dir: Path, cfg: MegatronConfig, train_vision_tower: bool = False) -> MegatronActor:
    chunks = build_vlm_model(hf_dir, cfg, train_vision_tower=train_vision_tower)
    optimizer, scheduler = build_optimizer(chunks, OPTIM, cfg)
    return MegatronActor(chunks, optimizer, scheduler, ActorUpdateConfig(ppo_micro_batch_size=2))


def snapshot(model, prefix: str) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters() if name.startswith(prefix)}


def moved(before: dict[str, torch.Tensor], model) -> list[str]:
    now = dict(model.named_parameters())
    return [name for name, value in before.items() if not torch.equal(now[name], value)]


def moved_on_any_rank(before: dict[str, torch.Tensor], model) -> list[str]:
    """A TP shard may hold no row the batch touches (an untied embedding's vocabulary half)."""
    names = sorted(before)
    mine = set(moved(before, model))
    flags = torch.tensor([float(name in mine) for name in names])
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=parallel_state.get_tensor_model_parallel_group())
    return [name for name, flag in zip(names, flags.tolist(), strict=True) if flag]


def check_frozen_tower_training(hf_dir: Path, cfg: MegatronConfig, data, rows, out_dir: Path) -> list[float]:
    actor = build_actor(hf_dir, cfg)
    model = unwrap_model(actor.chunks[0])
    before = {part: snapshot(model, part) for part in ("vision_model", "vision_projection", "language_model")}
    losses = [float(actor.update_sft(data)["sft_loss"]) for _ in range(STEPS)]
    assert losses[-1] < 0.9 * losses[0], f"SFT did not lower the loss: {losses}"
    assert not moved(before["vision_model"], model), "the frozen vision tower moved"
    for part in ("vision_projection", "language_model"):
        still = sorted(set(before[part]) - set(moved_on_any_rank(before[part], model)))
        assert not still, f"{part}: parameters that did not move: {still}"
    save_vlm_hf_checkpoint(model, model.vlm_config, cfg, out_dir)
    check_padded_log_probs(model.eval(), out_dir, rows, data)
    check_sync_into_engine(actor.chunks, hf_dir, out_dir, rows)
    return losses


def prompts_only(rows, pad_id: int) -> DataProto:
    """The rows' image prompts, left-padded, as the driver hands them to the rollout."""
    width = max(len(prompt) for prompt, _, _ in rows)
    ids = torch.full((len(rows), width), pad_id)  # (B, P)
    mask = torch.zeros_like(ids)
    for i, (prompt, _, _) in enumerate(rows):
        ids[i, width - len(prompt) :], mask[i, width - len(prompt) :] = torch.tensor(prompt), 1
    pixels = np.empty(len(rows), dtype=object)
    pixels[:] = [pixel for _, pixel, _ in rows]
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    tensors = {"input_ids": ids, "attention_mask": mask, "position_ids": positions}
    pixels = {PIXEL_VALUES_KEY: pixels}
    return DataProto.from_dict(tensors=tensors, non_tensors=pixels, meta_info={"validate": True})


def reference_greedy(export_dir: Path, rows, engine) -> list[list[int]]:
    """transformers' greedy continuation of each prompt alone, cut after its first EOS."""
    from transformers import LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration.from_pretrained(export_dir, dtype=torch.float32).eval()
    eos, responses = engine.eos_token_ids, []
    for prompt, pixels, _ in rows:
        extra = {PIXEL_VALUES_KEY: torch.as_tensor(pixels)} if len(pixels) else {}
        with torch.no_grad():
            out = model.generate(input_ids=torch.tensor([prompt]), do_sample=False, max_new_tokens=MAX_NEW,
                                 eos_token_id=eos, pad_token_id=engine.pad_token_id, **extra)  # fmt: skip
        tokens = out[0, len(prompt) :].tolist()
        ends = [i for i, token in enumerate(tokens) if token in eos]
        responses.append(tokens[: ends[0] + 1] if ends else tokens)
    return responses


def check_sync_into_engine(chunks, hf_dir: Path, export_dir: Path, rows) -> None:
    greedy = SamplingConfig(do_sample=False, temperature=0.0)
    cfg = RolloutConfig(response_length=MAX_NEW, load_format="dummy", sampling=greedy, val_sampling=greedy,
                        verify_weight_sync=True, weight_sync_bucket_mb=1)  # fmt: skip
    engine = HFRolloutEngine(hf_dir, cfg, device="cpu")
    manager = MegatronRolloutShardingManager(chunks, unwrap_model(chunks[0]).hf_config, engine, cfg)
    manager.load_weights()
    exported, params = load_file(export_dir / "model.safetensors"), checkpoint_tensors(engine.model)
    assert set(params) == set(exported), sorted(set(params) ^ set(exported))
    for name, param in params.items():
        assert torch.equal(param, exported[name]), f"{name}: the engine's tensor is not the actor's"
    with manager.generating():
        piece = manager.preprocess_data(prompts_only(rows, 0))
        out = manager.postprocess_data(engine.generate_sequences(piece))
    responses = zip(out.batch["responses"], out.batch["response_mask"], strict=True)
    got = [row[mask.bool()].tolist() for row, mask in responses]
    assert got == reference_greedy(export_dir, rows, engine), got


def check_trainable_tower(hf_dir: Path, cfg: MegatronConfig, data) -> None:
    actor = build_actor(hf_dir, cfg, train_vision_tower=True)
    model = unwrap_model(actor.chunks[0])
    tower = snapshot(model, "vision_model")
    actor.update_sft(data)
    assert moved(tower, model), "train_vision_tower=True left the tower unchanged"


def run(hf_dir: Path, out_dir: Path) -> str:
    cfg = MegatronConfig(tensor_model_parallel_size=int(os.environ["WORLD_SIZE"]))  # TP = every rank
    init_megatron(cfg)
    rows = batch_rows(hf_dir)
    data = padded_batch(rows, pad_id=0)
    losses = check_frozen_tower_training(hf_dir, cfg, data, rows, out_dir)
    check_trainable_tower(hf_dir, cfg, data)
    rank, rounded = parallel_state.get_tensor_model_parallel_rank(), [round(x, 3) for x in losses]
    return f"VLM TRAIN OK tp={cfg.tensor_model_parallel_size} rank={rank} losses={rounded}"


def main() -> None:
    args = parse_dirs()
    print(run(args.hf_dir, args.out_dir), flush=True)


if __name__ == "__main__":
    main()
