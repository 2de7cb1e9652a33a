"""Megatron-Core distributed checkpoints of one role: model, optimizer, LR schedule, RNG.

`save_checkpoint(chunks, optimizer, scheduler, path)` and `load_checkpoint(...)` are collective
(every rank of the job calls them). They write and read through `megatron.core.dist_checkpointing`
with each module's `sharded_state_dict`, so a checkpoint saved at one tensor / pipeline /
data-parallel layout loads at another: tensors are stored in their global (unsharded) shape and
each rank reads its own slices. Optimizer moments are sharded the same way as the parameters
they belong to (Megatron-Core's `FP32Optimizer.sharded_state_dict`, which the CPU optimizer
inherits, or the distributed optimizer's format from `distributed_optimizer_format`).

Limits: the distributed optimizer over torch's Adam (CUDA without Transformer Engine or apex)
loads only at the TP/PP it was saved at (`optimizer_reshard_problem` refuses the rest by name).
The padded vocabulary must be the same in both layouts (it is rounded up to
`make_vocab_size_divisible_by` x TP); RNG states are restored only at the layout they were saved
at, as Megatron-LM does, because a rank's random stream has no meaning in another layout.
`path` is written as given; the caller makes it atomic (temporary directory, then rename).

Helper processes: none outlive a save. megatron-core 0.16.1's `FileSystemWriterAsync` (the
torch_dist save strategy, used for synchronous saves too;
megatron/core/dist_checkpointing/strategies/filesystem_async.py) hands each save's write results
back through a module-level queue that it would create on the first save as a multiprocessing
Manager queue: a server process started with the "spawn" context (re-importing the worker's main
module, about 4 CPU-seconds) that lives as long as the process and outlives a SIGKILL of it. That
queue only crosses processes for async saves (`AsyncCallsQueue`), which hybridflow does not use: a
synchronous save puts and gets it in the saving process (`AsyncRequest.execute_sync`,
strategies/async_utils.py; `write_preloaded_data_multiproc` puts, `retrieve_write_results` gets).
`save_checkpoint` therefore provides a plain in-process queue first. The per-file writers are
forked, joined within the save, and killed with the saving process if it dies mid-save
(engines/megatron/forked_writers.py: an orphaned writer would hide the death from Ray).
"""

import queue
import random
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.dist_checkpointing.strategies import filesystem_async

from engines.megatron import cpu_compat
from engines.megatron.forked_writers import forks_die_with_this_process
from engines.megatron.model import unwrap_model
from engines.megatron.optimizer import inner_optimizers
from engines.megatron.parallel import parallel_ranks


def _layout() -> dict:
    ranks = parallel_ranks()
    return {"tp": ranks.tp_size, "pp": ranks.pp_size, "dp": ranks.dp_size}


def _rng_state() -> dict:
    state = {
        "random": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if cpu_compat.cuda_available():
        state["cuda"] = torch.cuda.get_rng_state()
        state["cuda_tracker"] = tensor_parallel.get_cuda_rng_tracker().get_states()
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["random"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if cpu_compat.cuda_available():
        torch.cuda.set_rng_state(state["cuda"])
        tensor_parallel.get_cuda_rng_tracker().set_states(state["cuda_tracker"])


def _rng_sharded_object() -> ShardedObject:
    """One RNG state per (pipeline, tensor) rank; data-parallel ranks hold replicas."""
    ranks = parallel_ranks()
    return ShardedObject(
        "rng_state",
        _rng_state(),
        (ranks.pp_size, ranks.tp_size),
        (ranks.pp, ranks.tp),
        replica_id=ranks.dp,
    )


def distributed_optimizer_format(torch_adam: bool) -> str:
    """The distributed optimizer's (CUDA) checkpoint format; the optimizers used without it (CPU)
    are given none, so their format is unchanged.

    Its default, fully_sharded_model_space, is refused by Megatron-Core 0.16.1's own ShardedTensor
    check ("flattened_range is not supported"). fully_reshardable loads at another TP/PP/DP layout,
    but its load trips over the per-parameter "step" that torch's Adam keeps (KeyError: 'step' in
    distrib_optimizer.py `_set_main_param_and_optimizer_states`; Transformer Engine's and apex's
    FusedAdam keep it per group). With torch's Adam (no TE or apex), dp_reshardable, which loads at
    the same TP/PP layout. Both failures seen on an H200 without TE, 2026-11-26."""
    return "dp_reshardable" if torch_adam else "fully_reshardable"


def _uses_torch_adam(optimizer) -> bool:
    return any(
        isinstance(getattr(inner, "optimizer", None), torch.optim.Adam | torch.optim.AdamW)
        for inner in inner_optimizers(optimizer)
    )


def optimizer_reshard_problem(format_: str | None, saved: dict, current: dict) -> str | None:
    """Why an optimizer saved in `format_` (None: not the distributed optimizer) cannot load at
    the `current` layout, or None. dp_reshardable holds flat per-bucket shards: only DP may change."""
    if format_ != "dp_reshardable" or (saved["tp"], saved["pp"]) == (current["tp"], current["pp"]):
        return None
    return (
        f"the distributed optimizer's state was saved at TP {saved['tp']} x PP {saved['pp']} in "
        f"Megatron-Core's dp_reshardable format (chosen because the optimizer is torch's Adam: no "
        f"Transformer Engine or apex), which loads only at the same TP/PP, not TP {current['tp']} x "
        f"PP {current['pp']}: resume at tensor_model_parallel_size={saved['tp']} and "
        f"pipeline_model_parallel_size={saved['pp']}, or load the weights alone (a new optimizer)"
    )


def give_each_parameter_its_step(optimizer) -> None:
    """Megatron-Core 0.16.1's `DistributedOptimizer.load_state_dict`, without TE or apex, puts one
    `step` tensor into every parameter's torch-Adam state (`s["step"] = step`, distrib_optimizer.py)
    and torch's `load_state_dict` keeps it shared (optimizer.py `_process_value_according_to_param_policy`
    returns `step` uncopied): Adam then adds 1 to it once per parameter each step, and its bias
    correction runs ahead. Likely why the update after a reload differed on an H200 (2026-11-26;
    found by reading after the device time ran out, so not yet run there). Harmless elsewhere."""
    for inner in inner_optimizers(optimizer):
        for state in getattr(getattr(inner, "optimizer", None), "state", {}).values():
            if torch.is_tensor(state.get("step")):
                state["step"] = state["step"].clone()


def _distributed_optimizer_format(optimizer) -> str | None:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    if not any(isinstance(inner, DistributedOptimizer) for inner in inner_optimizers(optimizer)):
        return None
    return distributed_optimizer_format(_uses_torch_adam(optimizer))


def _sharded_state_dict(chunks, optimizer, scheduler, *, is_loading: bool, with_rng: bool) -> dict:
    state = {f"model{i}": unwrap_model(chunk).sharded_state_dict() for i, chunk in enumerate(chunks)}
    if optimizer is not None:
        model_state = dict(state)
        sharding = _distributed_optimizer_format(optimizer)
        metadata = None if sharding is None else {"distrib_optim_sharding_type": sharding}
        state["optimizer"] = optimizer.sharded_state_dict(
            model_state, is_loading=is_loading, metadata=metadata
        )
    if scheduler is not None:
        state["scheduler"] = scheduler.state_dict()
    state["layout"] = _layout()
    if with_rng:
        state["rng_state"] = _rng_sharded_object()
    return state


def _provide_write_results_queue() -> None:
    """Gives megatron-core's writer an in-process results queue (see the module docstring);
    upstream would start a Manager server process for it on the first save."""
    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()


def save_checkpoint(chunks, optimizer, scheduler, path) -> None:
    """Write model (+ optimizer and scheduler when given) and RNG state into directory `path`."""
    _provide_write_results_queue()
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    state = _sharded_state_dict(chunks, optimizer, scheduler, is_loading=False, with_rng=True)
    with forks_die_with_this_process():
        dist_checkpointing.save(state, str(path))


def load_checkpoint(chunks, optimizer, scheduler, path) -> None:
    """Restore what `save_checkpoint` wrote, at this process's (possibly different) layout.

    Pass `optimizer=None` / `scheduler=None` to load only the weights (a frozen reference, or
    weights for evaluation); the optimizer must be built before loading its state.
    """
    path = Path(path)
    if not (path / "metadata.json").is_file():
        raise ValueError(f"{path} is not a Megatron distributed checkpoint (no metadata.json)")
    saved_layout = dist_checkpointing.load_common_state_dict(str(path))["layout"]
    same_layout = saved_layout == _layout()
    if optimizer is not None:
        problem = optimizer_reshard_problem(_distributed_optimizer_format(optimizer), saved_layout, _layout())
        if problem:
            raise ValueError(f"{path}: {problem}")
    state = _sharded_state_dict(chunks, optimizer, scheduler, is_loading=True, with_rng=same_layout)
    loaded = dist_checkpointing.load(state, str(path))
    for i, chunk in enumerate(chunks):
        unwrap_model(chunk).load_state_dict(loaded[f"model{i}"])
    if optimizer is not None:
        with torch.no_grad():  # the distributed optimizer copies into views of fp32 weights (leaves)
            optimizer.load_state_dict(loaded["optimizer"])
        give_each_parameter_its_step(optimizer)
    if scheduler is not None:
        scheduler.num_steps = 0  # Megatron's load_state_dict advances by the saved count
        scheduler.load_state_dict(loaded["scheduler"])
    if same_layout:
        _set_rng_state(loaded["rng_state"])
