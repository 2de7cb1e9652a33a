"""Move a role's parameters, gradients and optimizer state to host memory between phases.

Colocated roles share one GPU: while the rollout engine generates, the actor's training state
can wait in host memory (recipe switches `param_offload`, `grad_offload`, `optimizer_offload`).
Every function is a no-op without CUDA, where everything already lives in host memory.

The DDP buffers move through Megatron-Core's own `offload_to_cpu` / `reload_from_cpu`
(contiguous grad buffer, and the contiguous param buffer under the distributed optimizer;
megatron/core/distributed/param_and_grad_buffer.py 964-990). The optimizers' moments and the fp32
master copies of bf16/fp16 weights move tensor by tensor, not through the optimizers'
`offload_to_cpu`, which also moves views of fp32 weights (see `_own_master_weights`). Parameters
outside a contiguous buffer (no distributed optimizer, or a frozen reference model) move one by
one.

`actor_offload_hooks(cfg, chunks, optimizer)` wires the three switches into the rollout sharding
manager's hooks: gradients (zeroed before the next update anyway) and optimizer state leave before
the rollout engine's weights are resumed, parameters once they are synced into it, and all come
back after generation; the allocator's cached blocks are freed before the engine resumes its
memory whatever the switches say, so that SGLang finds the memory the actor no longer uses.
"""

import torch
from megatron.core.optimizer.optimizer import MixedPrecisionOptimizer

from engines.megatron import cpu_compat
from engines.megatron.config import MegatronConfig
from engines.megatron.optimizer import inner_optimizers
from engines.rollout.sharding_manager import OffloadHooks


def _ddp_buffers(chunk) -> list:
    """Megatron DDP's contiguous param/grad buffers; none for a bare module (a frozen reference,
    whose `buffers` is nn.Module's method)."""
    buffers = getattr(chunk, "buffers", None)
    if not isinstance(buffers, list):
        return []
    return buffers + list(getattr(chunk, "expert_parallel_buffers", []))


def _params_in_buffers(chunk) -> bool:
    return any(getattr(b, "param_data", None) is not None for b in _ddp_buffers(chunk))


def offload_model(chunks: list, params: bool = True, grads: bool = True) -> None:
    """Free the GPU copies of the chunks' parameters and/or gradient buffers."""
    if not cpu_compat.cuda_available():
        return
    torch.cuda.synchronize()
    for chunk in chunks:
        for buffer in _ddp_buffers(chunk):
            move_params = params and buffer.param_data is not None
            buffer.offload_to_cpu(move_params=move_params, move_grads=grads)
        if params and not _params_in_buffers(chunk):
            for param in chunk.parameters():
                param.data = param.data.to("cpu", non_blocking=True).pin_memory()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def reload_model(chunks: list, params: bool = True, grads: bool = True) -> None:
    """Bring back what `offload_model` freed; reloaded gradient buffers are zero."""
    if not cpu_compat.cuda_available():
        return
    device = torch.cuda.current_device()
    for chunk in chunks:
        for buffer in _ddp_buffers(chunk):
            buffer.reload_from_cpu(move_params=params and buffer.param_data is not None, move_grads=grads)
        if params and not _params_in_buffers(chunk):
            for param in chunk.parameters():
                param.data = param.data.to(device, non_blocking=True)
    torch.cuda.synchronize()


def _move_state(megatron_optimizer, device) -> None:
    """Adam moments only: in an fp32 optimizer the param groups hold the model's own parameters."""
    inner = megatron_optimizer.optimizer
    if inner is None:
        return
    for state in inner.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and key != "step":
                state[key] = value.to(device, non_blocking=True)


def _own_master_weights(inner) -> list[torch.Tensor]:
    """The fp32 master copies of bf16/fp16 parameters, which have storage of their own.

    The master weights of fp32 parameters are the model's own (the distributed optimizer's
    `shard_fp32_groups` are views of its param buffer): they move with the model. Megatron-Core's
    `offload_to_cpu` moves every tensor of the param groups, which turns those views into copies
    (the fp32 weights twice on the GPU after the reload) and fails with "CUDA error: invalid
    argument" when the model's buffer was offloaded first (seen on an H200, 2026-11-26)."""
    groups = getattr(inner, "shard_fp32_from_float16_groups", None)  # distributed optimizer
    if groups is None:
        groups = getattr(inner, "fp32_from_float16_groups", [])  # Float16OptimizerWithFloat16Params
    return [param for group in groups for param in group]


def _move_optimizer(inner, device) -> None:
    _move_state(inner, device)
    if isinstance(inner, MixedPrecisionOptimizer):
        for param in _own_master_weights(inner):
            param.data = param.data.to(device, non_blocking=True)


def offload_optimizer(optimizer) -> None:
    """Move optimizer state (and fp32 master copies of bf16/fp16 weights) to the host."""
    if optimizer is None or not cpu_compat.cuda_available():
        return
    for inner in inner_optimizers(optimizer):
        _move_optimizer(inner, "cpu")
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def reload_optimizer(optimizer) -> None:
    """Bring back what `offload_optimizer` moved."""
    if optimizer is None or not cpu_compat.cuda_available():
        return
    for inner in inner_optimizers(optimizer):
        _move_optimizer(inner, torch.cuda.current_device())
    torch.cuda.synchronize()


def empty_device_cache() -> None:
    """Return the caching allocator's unused blocks to the device (a no-op without CUDA)."""
    if cpu_compat.cuda_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def actor_offload_hooks(cfg: MegatronConfig, chunks: list, optimizer) -> OffloadHooks:
    """The sharding manager's hooks for `cfg.param_offload`, `grad_offload`, `optimizer_offload`."""

    def before_resume() -> None:
        if cfg.grad_offload:
            offload_model(chunks, params=False, grads=True)
        if cfg.optimizer_offload:
            offload_optimizer(optimizer)
        empty_device_cache()

    def after_sync() -> None:
        if cfg.param_offload:
            offload_model(chunks, params=True, grads=False)

    def after_release() -> None:
        if cfg.param_offload or cfg.grad_offload:
            reload_model(chunks, params=cfg.param_offload, grads=cfg.grad_offload)
        if cfg.optimizer_offload:
            reload_optimizer(optimizer)

    return OffloadHooks(before_resume=before_resume, after_sync=after_sync, after_release=after_release)
