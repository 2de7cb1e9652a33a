"""torchrun worker for test_recompute.py: activation recompute on CPU ranks, with and without
routing replay, at PP = the world size (Megatron's 1F1B schedule over gloo at 2 ranks).

Each check builds a fresh model from the same tiny checkpoint, runs one training pass of a
token-mean NLL over the responses (`run_micro_batches(forward_only=False)`, 4 micro-batches of 2
rows) and keeps the loss and every parameter's gradient (`main_grad`, this stage's):
  dense:  tiny Qwen2; full recompute (uniform and block) against no recompute: the loss and every
          gradient equal.
  replay: tiny Qwen3-MoE with routing replay of random routes, a different expert set per token and
          so per micro-batch; full recompute and MoE-layer recompute against no recompute: equal (at
          PP 2 the 1F1B schedule runs forward(mb i+1) before backward(mb i), so a recompute with the
          latest micro-batch's routes would differ); and the routes are used (the gradients without
          replay differ).
  aux:    tiny Qwen3-MoE with a load-balancing loss and replay: each row alone in its micro-batch,
          once left/right-padded and once cut to its real tokens (their routes cut alike): the
          router's load-balancing loss of every layer equals the unpadded one's.
Prints "RECOMPUTE OK <check> rank=<rank>" per check and rank.

    torchrun --nproc_per_node 2 tests/megatron/_recompute_worker.py --work-dir /tmp/rc
"""

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core.transformer.moe.moe_utils import (
    clear_aux_losses_tracker,
    get_moe_layer_wise_logging_tracker,
)
from megatron.core.transformer.transformer_layer import TransformerLayer
from tiny_hf import make_tiny_hf_checkpoint, padded_batch

from engines.megatron import forward
from engines.megatron.build import build_model
from engines.megatron.config import MegatronConfig
from engines.megatron.model import load_hf_config
from engines.megatron.moe import AUX_LOSS_NAME
from engines.megatron.parallel import init_megatron
from engines.megatron.routing_replay import ROUTES_KEY, moe_routers
from hybridflow.protocol import DataProto

PROMPT_LEN, RESPONSE_LEN, VOCAB, MICRO_BATCH = 6, 5, 130, 2
RECOMPUTE = {
    "none": {},
    "full-uniform": {
        "recompute_granularity": "full",
        "recompute_method": "uniform",
        "recompute_num_layers": 1,
    },
    "full-block": {"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 1},
    "moe-layer": {"recompute_granularity": "selective", "recompute_modules": ["moe"]},
}


def rows(count: int = 8) -> dict[str, torch.Tensor]:
    """Left-padded prompts and right-padded responses of unequal lengths, (count, P+R)."""
    prompts = [6, 3, 5, 2] * (count // 4)
    responses = [5, 2, 4, 1] * (count // 4)
    return padded_batch(prompts, responses, PROMPT_LEN, RESPONSE_LEN, VOCAB, seed=3)


def random_routes(shape: tuple[int, int], layers: int, experts: int, topk: int, seed: int) -> torch.Tensor:
    """(b, T, L, k) int16: k distinct experts per token and layer, drawn at random."""
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(*shape, layers, experts, generator=gen).argsort(-1)[..., :topk].to(torch.int16)


def nll(logits, micro_batch):
    log_probs, _ = forward.response_log_probs(logits, micro_batch, 1.0, VOCAB, "none")  # (b, R)
    mask = micro_batch["response_mask"]
    loss = -(log_probs * mask).sum() / mask.sum()
    return loss, {"loss": loss.detach().clone()}


def train_pass(hf_dir: Path, tensors: dict, recompute: str, micro_batch=MICRO_BATCH, **settings) -> tuple:
    """A fresh model's losses (last stage), gradients by name and forward calls of its routers (MoE)
    or layers (dense) in one training pass: a recompute calls them again in backward."""
    cfg = MegatronConfig(
        pipeline_model_parallel_size=dist.get_world_size(), transformer=RECOMPUTE[recompute], **settings
    )
    init_megatron(cfg, load_hf_config(hf_dir))
    chunks = build_model(hf_dir, cfg)
    chunks[0].train()
    counted = moe_routers(chunks[0]) or [m for m in chunks[0].modules() if isinstance(m, TransformerLayer)]
    calls = []
    for module in counted:
        module.register_forward_hook(lambda *_: calls.append(1))
    metrics = forward.run_micro_batches(
        chunks, DataProto.from_dict(tensors), micro_batch, nll, forward_only=False
    )
    grads = {name: p.main_grad.clone() for name, p in chunks[0].named_parameters()}
    return [m["loss"] for m in metrics], grads, len(calls)


def assert_same(reference: tuple, recomputed: tuple, what: str) -> None:
    """Equal losses and gradients, and the recompute ran (more forward calls than the reference's)."""
    (losses, grads, calls), (other_losses, other_grads, other_calls) = reference, recomputed
    assert other_calls > calls, f"{what}: no recompute ran ({other_calls} forward calls, {calls} without)"
    if losses:  # the last stage
        assert torch.allclose(torch.stack(losses), torch.stack(other_losses), rtol=1e-6), (
            losses,
            other_losses,
        )
    for name, grad in grads.items():
        assert torch.allclose(grad, other_grads[name], rtol=1e-5, atol=1e-7), (
            f"{what}: {name} differs by {float((grad - other_grads[name]).abs().max()):.3e} "
            f"(largest gradient {float(grad.abs().max()):.3e})"
        )


def check_dense(work_dir: Path) -> None:
    hf_dir = work_dir / "qwen2"
    reference = train_pass(hf_dir, rows(), "none")
    for recompute in ("full-uniform", "full-block"):
        assert_same(reference, train_pass(hf_dir, rows(), recompute), f"dense {recompute}")


def check_replay(work_dir: Path) -> None:
    hf_dir = work_dir / "qwen3_moe"
    hf_config = load_hf_config(hf_dir)
    tensors = rows()
    routes = random_routes(tensors["input_ids"].shape, 2, hf_config.num_experts, hf_config.moe_router_topk, 4)
    replayed = {**tensors, ROUTES_KEY: routes}
    settings = {"moe_routing_replay": "rollout", "moe_aux_loss_coeff": 0.01}
    reference = train_pass(hf_dir, replayed, "none", **settings)
    for recompute in ("full-uniform", "moe-layer"):
        assert_same(reference, train_pass(hf_dir, replayed, recompute, **settings), f"replay {recompute}")
    _, own_grads, _ = train_pass(hf_dir, tensors, "none", **settings)
    router = next(name for name in own_grads if name.endswith("router.weight"))
    assert not torch.allclose(own_grads[router], reference[1][router]), "replay changed nothing"


def layer_aux_losses(hf_dir: Path, tensors: dict, settings: dict) -> torch.Tensor:
    """(L,) the load-balancing loss of each layer on this stage (0 elsewhere) after a training pass."""
    clear_aux_losses_tracker()
    train_pass(hf_dir, tensors, "none", micro_batch=1, **settings)
    return get_moe_layer_wise_logging_tracker()[AUX_LOSS_NAME]["values"].detach().clone()


def check_aux(work_dir: Path) -> None:
    hf_dir = work_dir / "qwen3_moe"
    hf_config = load_hf_config(hf_dir)
    tensors = rows(4)
    routes = random_routes(tensors["input_ids"].shape, 2, hf_config.num_experts, hf_config.moe_router_topk, 5)
    settings = {"moe_routing_replay": "rollout", "moe_aux_loss_coeff": 0.01}
    for row in range(4):
        real = tensors["attention_mask"][row].bool()  # (T,)
        padded = {key: value[row : row + 1] for key, value in tensors.items()} | {
            ROUTES_KEY: routes[row : row + 1]
        }
        prompt_real = int(real[:PROMPT_LEN].sum())
        cut = {
            "input_ids": tensors["input_ids"][row : row + 1, real],
            "attention_mask": tensors["attention_mask"][row : row + 1, real],
            "position_ids": torch.arange(int(real.sum()))[None],
            "responses": tensors["input_ids"][row : row + 1, real][:, prompt_real:],
            "response_mask": tensors["attention_mask"][row : row + 1, real][:, prompt_real:],
            ROUTES_KEY: routes[row : row + 1, real],
        }
        with_padding, without = (layer_aux_losses(hf_dir, batch, settings) for batch in (padded, cut))
        assert with_padding.any(), "no load-balancing loss was recorded"
        assert torch.allclose(with_padding, without, rtol=1e-5, atol=1e-7), (row, with_padding, without)


CHECKS = {"dense": check_dense, "replay": check_replay, "aux": check_aux}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--work-dir", type=Path, required=True)
    parser.add_argument("--checks", default=",".join(CHECKS))
    args = parser.parse_args()
    dist.init_process_group("gloo")
    if dist.get_rank() == 0:
        for arch in ("qwen2", "qwen3_moe"):
            if not (args.work_dir / arch / "config.json").exists():
                make_tiny_hf_checkpoint(args.work_dir / arch, arch=arch, num_layers=2, vocab_size=VOCAB)
    dist.barrier()
    for name in args.checks.split(","):
        CHECKS[name](args.work_dir)
        print(f"RECOMPUTE OK {name} rank={dist.get_rank()}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
