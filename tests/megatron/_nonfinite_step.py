"""Worker for test_nonfinite_step.py (one process, gloo): `optimizer_step` on Megatron-Core's
FP32 optimizer (the CPU one) leaves weights, Adam moments and LR schedule untouched when the
gradient norm is NaN or inf, and reports it; a finite gradient then updates as usual."""

import json

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from engines.megatron.config import MegatronConfig, OptimConfig
from engines.megatron.optimizer import _build_cpu_optimizer, build_scheduler, megatron_optimizer_config
from engines.megatron.training import optimizer_step


def snapshot(model, optimizer) -> list[torch.Tensor]:
    moments = [t for state in optimizer.optimizer.state.values() for t in state.values()]
    return [p.detach().clone() for p in model.parameters()] + [t.clone() for t in moments]


def same_tensors(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def main() -> None:
    dist.init_process_group("gloo")
    parallel_state.initialize_model_parallel(1, 1)
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optim = OptimConfig(lr=0.1, clip_grad=1.0)
    optimizer = _build_cpu_optimizer([model], megatron_optimizer_config(optim, MegatronConfig()))
    scheduler = build_scheduler(optimizer, optim)
    results = {}
    for name, bad in (("nan", float("nan")), ("inf", float("inf"))):
        before = snapshot(model, optimizer)
        for param in model.parameters():
            param.grad = torch.ones_like(param)
            param.grad[0] = bad
        step = optimizer_step(optimizer, scheduler)
        after = snapshot(model, optimizer)
        results[name] = {
            "step": step,
            "unchanged": same_tensors(before, after),
            "scheduler_steps": scheduler.num_steps,
        }
    weights = [p.detach().clone() for p in model.parameters()]
    for param in model.parameters():
        param.grad = torch.ones_like(param)
    step = optimizer_step(optimizer, scheduler)
    changed = not same_tensors(weights, [p.detach() for p in model.parameters()])
    results["finite"] = {"step": step, "changed": changed, "scheduler_steps": scheduler.num_steps}
    print("RESULT " + json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
