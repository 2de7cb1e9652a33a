"""The router load-balancing loss of mixture-of-experts models, as a training metric.

Megatron-Core's router adds `moe_aux_loss_coeff x` the Switch-Transformer load-balancing loss
(Fedus et al. 2021, https://arxiv.org/abs/2101.03961, eq. 4) to the gradients itself (through
`MoEAuxLossAutoScaler`, scaled by the schedule like the main loss) and records each layer's
unscaled loss in its layer-wise tracker, only in training forwards with a coefficient > 0.
This module reads that tracker: Megatron's own reduction averages over data-parallel ranks with
ReduceOp.AVG, which gloo lacks, so the reduction here sums and divides.
"""

import torch.distributed as dist

AUX_LOSS_NAME = "load_balancing_loss"  # the router's tracker key (megatron/core/transformer/moe/router.py)


def clear_aux_loss() -> None:
    """Zero the tracker before an update."""
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker

    clear_aux_losses_tracker()


def mean_aux_loss(num_micro_batches: int) -> float | None:
    """The load-balancing loss averaged over layers, this rank's `num_micro_batches` training
    forwards since `clear_aux_loss` and the data-parallel ranks; None when nothing was recorded
    (a dense model, or moe_aux_loss_coeff = 0). Collective over the pipeline and DP groups."""
    from megatron.core import parallel_state
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    entry = get_moe_layer_wise_logging_tracker().get(AUX_LOSS_NAME)
    if entry is None or not bool(entry["values"].any()):  # the tracker outlives models: zeros = unused
        return None
    per_layer = entry["values"].detach().clone().double()  # (num_layers,), this stage's layers set
    dist.all_reduce(per_layer, group=parallel_state.get_pipeline_model_parallel_group())
    total = per_layer.sum() / (len(per_layer) * num_micro_batches)
    dist.all_reduce(total, group=parallel_state.get_data_parallel_group())
    return float(total) / parallel_state.get_data_parallel_world_size()
