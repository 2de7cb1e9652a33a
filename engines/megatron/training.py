"""The parts of one optimizer update shared by the actor and the critic.

Loss normalisation. A mini-batch of G sequences is split over D data-parallel ranks and, on
each rank, into M micro-batches. A micro-batch loss l_i is normalised by the token / sequence
counts of the WHOLE mini-batch (`global_counts`), so the l_i of all micro-batches on all ranks
add up to the loss of the mini-batch taken at once. Megatron-Core's schedule divides each
returned loss by M, and its DDP pre-scales gradients by 1/D before summing them over the
data-parallel group; returning l_i * M * D (`loss_scale`) undoes both, so the gradient equals
that of a single-process full-batch step. Tensor / pipeline ranks hold the same loss (or none)
and need no correction. With token budgets (`use_dynamic_bsz`) M is the number of packed
micro-batches of this mini-batch, the same on every data-parallel rank (forward.token_budget_groups),
and the same identity holds whatever rows each micro-batch holds.
"""

import math
from functools import partial

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state

from engines.megatron import forward
from engines.megatron.optimizer import current_lr, update_to_weight_ratio
from hybridflow.protocol import DataProto


def require_keys(data: DataProto, keys, method: str) -> None:
    missing = [k for k in keys if data.batch is None or k not in data.batch]
    if missing:
        raise ValueError(f"{method} needs batch keys {missing}, which the DataProto lacks")


def require_optimizer(optimizer, scheduler, method: str) -> None:
    if optimizer is None or scheduler is None:
        raise ValueError(
            f"{method} needs an optimizer and scheduler; this model was built without them (frozen: "
            "a reference policy or a reward model)"
        )


def update_epochs(chunks, optimizer, scheduler, data: DataProto, cfg, role: str, loss_fn, shuffle, seed):
    """`cfg.ppo_epochs` passes over `data` in mini-batches, one optimizer step each; the metrics
    hold one value per step; returned with this rank's number of micro-batches run (the same on
    every pipeline stage). `loss_fn(counts, scale, output, micro_batch)` is called with the
    mini-batch's `global_counts` and the `loss_scale` (see the module docstring). Micro-batches:
    packed under `cfg.max_token_len_per_gpu` tokens with `cfg.use_dynamic_bsz`, else padded
    `cfg.ppo_micro_batch_size` rows."""
    micro = 1 if cfg.use_dynamic_bsz else cfg.ppo_micro_batch_size
    local_size = local_mini_batch_size(cfg.ppo_mini_batch_size, micro, len(data), role)
    metrics: dict[str, list[float]] = {}
    num_micro_batches = 0
    for mini_batch in mini_batches(data, local_size, cfg.ppo_epochs, shuffle, seed):
        counts = global_counts(mini_batch.batch["response_mask"])
        if cfg.use_dynamic_bsz:
            key = f"{role}.update.max_token_len_per_gpu"
            micro = forward.token_budget_groups(mini_batch, cfg.max_token_len_per_gpu, key)
        num_micro = local_size // micro if isinstance(micro, int) else len(micro)
        num_micro_batches += num_micro
        scale = loss_scale(num_micro)
        loss = partial(loss_fn, counts, scale)
        step = train_step(chunks, optimizer, scheduler, mini_batch, micro, loss, cfg.max_update_ratio)
        for key, value in step.items():
            metrics.setdefault(key, []).append(value)
    return metrics, num_micro_batches


def local_mini_batch_size(global_mini_batch_size: int, micro_batch_size: int, rows: int, key: str) -> int:
    """This rank's rows per mini-batch; ValueError naming `key` unless the sizes divide evenly."""
    dp = parallel_state.get_data_parallel_world_size()
    if global_mini_batch_size % dp:
        raise ValueError(
            f"{key}.ppo_mini_batch_size={global_mini_batch_size} must be a multiple of the "
            f"data-parallel size {dp}"
        )
    local = global_mini_batch_size // dp
    if rows % local:
        raise ValueError(
            f"this rank holds {rows} rows, not a multiple of {key}.ppo_mini_batch_size / dp = {local}"
        )
    if local % micro_batch_size:
        raise ValueError(
            f"{key}.ppo_micro_batch_size={micro_batch_size} must divide the per-rank mini-batch "
            f"of {local} rows"
        )
    return local


def mini_batches(data: DataProto, local_size: int, epochs: int, shuffle: bool, seed: int):
    """Yield `local_size`-row mini-batches for `epochs` passes; rows reshuffled per epoch if asked."""
    for epoch in range(epochs):
        epoch_data = data
        if shuffle:
            gen = torch.Generator().manual_seed(seed + epoch)
            epoch_data = data[torch.randperm(len(data), generator=gen).numpy().astype(np.int64)]
        yield from epoch_data.split(local_size)


def global_counts(response_mask: torch.Tensor) -> tuple[float, float]:
    """(valid tokens, sequences with a valid token) of the mini-batch over all data-parallel ranks."""
    counts = torch.stack([response_mask.sum(), (response_mask.sum(dim=-1) > 0).sum()]).double()
    if torch.cuda.is_available():  # NCCL reduces device tensors only; batches arrive on the host
        counts = counts.cuda()
    dist.all_reduce(counts, group=parallel_state.get_data_parallel_group())
    return float(counts[0]), float(counts[1])


def loss_scale(num_micro_batches: int) -> float:
    """Factor that cancels the schedule's 1/M and DDP's 1/D (see the module docstring)."""
    return float(num_micro_batches * parallel_state.get_data_parallel_world_size())


def train_step(
    chunks,
    optimizer,
    scheduler,
    batch: DataProto,
    micro_batches,
    loss_fn,
    max_update_ratio: float | None = None,
) -> dict[str, float]:
    """Zero grads, forward/backward every micro-batch, one optimizer step (refused beyond
    `max_update_ratio`, see optimizer_step); the step's metrics. `micro_batches`: rows per padded
    micro-batch, or packed row groups (forward.run_micro_batches)."""
    for chunk in chunks:
        chunk.train()
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    per_micro = forward.run_micro_batches(chunks, batch, micro_batches, loss_fn, forward_only=False)
    step = optimizer_step(optimizer, scheduler, max_update_ratio)
    return {**(sum_over_data_parallel(per_micro) if per_micro else {}), **step}


def optimizer_step(optimizer, scheduler, max_update_ratio: float | None = None) -> dict[str, float]:
    """Clip, step, advance the LR schedule; the grad norm (before clipping) and the LR used.

    Two guards run before the step, and a refused step is not applied (weights, optimizer moments
    and LR schedule stay as they were), for the driver to stop the run or count the skip:
    - a NaN / inf grad norm: `nonfinite_skipped` is 1;
    - with `max_update_ratio`, a step whose predicted ||dw|| / ||w|| (`update_to_weight_ratio`)
      exceeds it: `update_refused` is 1. `update_ratio_max` reports that ratio either way.
    The norms are all-reduced over the model-parallel group and the gradients over the
    data-parallel group, so every rank decides the same."""
    lr = current_lr(optimizer)
    # prepare_grads (the main-grad copy) runs again inside step(): harmless, as it is a plain copy
    # when there is no grad scaler, and megatron_optimizer_config sets neither fp16 nor loss_scale.
    optimizer.prepare_grads()
    grad_norm = float(optimizer.get_grad_norm())
    metrics = {"grad_norm": grad_norm, "lr": lr, "nonfinite_skipped": float(not math.isfinite(grad_norm))}
    if metrics["nonfinite_skipped"]:
        return metrics
    if max_update_ratio is not None:
        ratio = update_to_weight_ratio(optimizer, grad_norm)
        metrics.update(update_ratio_max=ratio, update_refused=float(not ratio <= max_update_ratio))
        if metrics["update_refused"]:
            return metrics
    optimizer.step()
    scheduler.step(1)
    return metrics


def sum_over_data_parallel(per_micro_batch: list[dict[str, torch.Tensor]]) -> dict[str, float]:
    """Sum each metric over micro-batches and data-parallel ranks (last pipeline stage only).

    Metrics are pre-weighted by the global counts, so the sums are mini-batch values.
    """
    keys = sorted(per_micro_batch[0])
    totals = torch.stack([sum(m[k].detach().double() for m in per_micro_batch) for k in keys])
    dist.all_reduce(totals, group=parallel_state.get_data_parallel_group())
    return dict(zip(keys, totals.tolist(), strict=True))
