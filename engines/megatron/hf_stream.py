"""The actor's weights as Hugging Face tensors for the weight sync, whichever model `build.py` made:
a GPT model's stream (weights.py) or a LLaVA model's (vlm_weights.py, recognised by the
`vlm_config` that `build_vlm_model` puts on its chunk). Both are collective over the model-parallel
ranks and yield (HF checkpoint name, full contiguous tensor) in the order their shapes list.
"""

from collections.abc import Iterator

import torch

from engines.megatron.model import unwrap_model
from engines.megatron.vlm_weights import iter_vlm_hf_tensors, vlm_stream_tensor_shapes
from engines.megatron.weights import iter_hf_tensors, stream_tensor_shapes, tp_staging


def _vlm_of(chunks):
    return getattr(unwrap_model(chunks[0]), "vlm_config", None)


def actor_stream_shapes(chunks, hf_config) -> dict[str, tuple[int, ...]]:
    """The (HF name, shape) pairs `actor_hf_tensors` yields, without moving a tensor."""
    vlm = _vlm_of(chunks)
    if vlm is None:
        return stream_tensor_shapes(chunks, hf_config)
    return vlm_stream_tensor_shapes(vlm, unwrap_model(chunks[0]).megatron_config)


def actor_staging(chunks, hf_config):
    """weights.py's shared-memory TP gather for a GPT model; None for LLaVA (its stream gathers
    each tensor over the TP group)."""
    return None if _vlm_of(chunks) is not None else tp_staging(chunks, hf_config)


def actor_hf_tensors(chunks, hf_config, copies: bool, staging) -> Iterator[tuple[str, torch.Tensor]]:
    """`iter_hf_tensors` for a GPT model (`copies`, `staging` as there); for LLaVA
    `iter_vlm_hf_tensors`, whose tensors are always copies."""
    vlm = _vlm_of(chunks)
    if vlm is None:
        return iter_hf_tensors(chunks, hf_config, copies=copies, staging=staging)
    return iter_vlm_hf_tensors(unwrap_model(chunks[0]), vlm, unwrap_model(chunks[0]).megatron_config)
