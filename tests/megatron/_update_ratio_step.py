"""Worker for test_update_ratio.py (one process, gloo), on Megatron-Core's FP32 optimizer (the
CPU one) over a 16 -> 8 linear layer (weight with decay, bias without, as Megatron groups them):

- the ||dw|| / ||w|| that `optimizer_step` predicts before a step equals the change torch's AdamW
  step then makes, over steps with and without clipping and with Adam moments from earlier steps;
- with lr 0.5 the first step's predicted ratio exceeds max_update_ratio 0.25: the step is refused
  and weights, Adam moments and LR schedule stay as they were.
"""

import json

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from engines.megatron.config import MegatronConfig, OptimConfig
from engines.megatron.optimizer import _build_cpu_optimizer, build_scheduler, megatron_optimizer_config
from engines.megatron.training import optimizer_step


def build(lr: float, clip_grad: float):
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 8)
    optim = OptimConfig(lr=lr, clip_grad=clip_grad, weight_decay=0.1, lr_limits=[1e-9, 1.0])
    optimizer = _build_cpu_optimizer([model], megatron_optimizer_config(optim, MegatronConfig()))
    return model, optimizer, build_scheduler(optimizer, optim)


def weights(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])


def state(model, optimizer) -> list[torch.Tensor]:
    moments = [
        t.clone() for s in optimizer.optimizer.state.values() for t in s.values() if torch.is_tensor(t)
    ]
    return [weights(model), *moments]


def set_gradients(model, scale: float) -> None:
    for param in model.parameters():
        param.grad = torch.randn_like(param) * scale


def predicted_and_actual(scales: list[float]) -> list[dict]:
    model, optimizer, scheduler = build(lr=1e-2, clip_grad=1.0)
    steps = []
    for scale in scales:  # scale 10: grad norm ~40, clipped; 0.01: not clipped
        set_gradients(model, scale)
        before = weights(model)
        step = optimizer_step(optimizer, scheduler, max_update_ratio=1e9)
        actual = float((weights(model) - before).norm() / before.norm())
        steps.append(
            {"predicted": step["update_ratio_max"], "actual": actual, "grad_norm": step["grad_norm"]}
        )
    return steps


def refused_step() -> dict:
    model, optimizer, scheduler = build(lr=0.5, clip_grad=1.0)
    set_gradients(model, 1.0)
    before = state(model, optimizer)
    step = optimizer_step(optimizer, scheduler, max_update_ratio=0.25)
    after = state(model, optimizer)
    unchanged = len(before) == len(after) and all(
        torch.equal(a, b) for a, b in zip(before, after, strict=True)
    )
    return {"step": step, "unchanged": unchanged, "scheduler_steps": scheduler.num_steps}


def main() -> None:
    dist.init_process_group("gloo")
    parallel_state.initialize_model_parallel(1, 1)
    results = {"steps": predicted_and_actual([10.0, 0.01, 10.0, 0.01]), "refused": refused_step()}
    print("RESULT " + json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
