"""`rollout.vllm_cpu_weights`: how vLLM's CPU build holds the weights of its linear layers, which
decides how a sync loads them (docs/engines.md has the measurements). Written against vLLM 0.32.0.

  - `packed` (vLLM's default): once loaded, each linear layer's weight is prepacked into a oneDNN
    handle and the parameter left with 0 elements (`dispatch_cpu_unquantized_gemm`,
    vllm/model_executor/layers/utils.py, run by `UnquantizedLinearMethod.
    process_weights_after_loading`, layers/linear.py). A sync must go through vLLM's layerwise
    reload, which re-packs every layer: on CPU most of a sync's time.
  - `plain`: the engine is built with vLLM's oneDNN dispatch off (`vllm._custom_ops.
    _supports_onednn`, read as each layer is processed), so its linears run
    `torch.nn.functional.linear` on their own parameters, and a sync is vLLM's `model.load_weights`
    into those parameters in place, with nothing to re-process. Generation is slower. Only for
    models whose every layer with a weight method is an unquantized linear or embedding: other
    layers (MoE experts, quantized layers) transform their weights after loading, which a plain
    load would skip; `check_plain_weights` refuses them.
"""

from collections.abc import Iterator
from contextlib import contextmanager

import torch

PLAIN_WEIGHT_METHODS = ("UnquantizedLinearMethod", "UnquantizedEmbeddingMethod")


@contextmanager
def onednn_dispatch(enabled: bool) -> Iterator[None]:
    """vLLM's CPU linears built inside this block prepack for oneDNN only if `enabled`."""
    from vllm import _custom_ops

    saved = _custom_ops._supports_onednn
    _custom_ops._supports_onednn = saved and enabled
    try:
        yield
    finally:
        _custom_ops._supports_onednn = saved


def check_plain_weights(model: torch.nn.Module) -> None:
    """ValueError unless every layer of vLLM's `model` keeps its weights as plain parameters that
    `load_weights` can overwrite in place (run on each worker after the engine is built)."""
    other_methods = sorted(
        {
            f"{name} ({type(module.quant_method).__name__})"
            for name, module in model.named_modules()
            if getattr(module, "quant_method", None) is not None
            and type(module.quant_method).__name__ not in PLAIN_WEIGHT_METHODS
        }
    )
    emptied = [name for name, param in model.named_parameters() if param.numel() == 0]
    if other_methods or emptied:
        found = other_methods[:3] or [f"0-element parameters {emptied[:3]}"]
        raise ValueError(
            "rollout.vllm_cpu_weights=plain needs every vLLM layer to keep plain weights, but this "
            f"model's {', '.join(found)} process their weights after loading (MoE experts, quantized "
            "layers, or a CPU kernel that prepacks anyway); use rollout.vllm_cpu_weights=packed"
        )
