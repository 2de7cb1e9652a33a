"""Noise on a Megatron actor's weights, for the sync workers (`_sync_worker.py`, `_vllm_worker.py`):
after it the actor differs from its checkpoint, so an engine that generates like the actor got
its weights through the sync."""

import torch

from engines.megatron.model import unwrap_model


@torch.no_grad()
def perturb(chunks) -> None:
    """Noise on every actor parameter, identical on the TP ranks that replicate a parameter."""
    from megatron.core import parallel_state

    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    for name, param in unwrap_model(chunks[0]).named_parameters():
        split = getattr(param, "tensor_model_parallel", False)
        seed = (sum(map(ord, name)) * 31 + pp_rank) * 7 + (tp_rank if split else 0)
        noise = torch.randn(param.shape, generator=torch.Generator().manual_seed(seed))
        param.add_(0.05 * noise.to(param.dtype))
