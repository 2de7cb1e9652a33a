"""The names and shapes a rollout model takes, read from its config alone (a model built on the
meta device): what the actor's stream is checked against before anything is sent.

Apart from `common` because the names are the hf engine's checkpoint names
(`engines.rollout.hf_rollout.checkpoint_tensors`: per-expert names for transformers' fused
experts), and the hf engine itself imports `common`.
"""

from functools import cache
from pathlib import Path

import torch

from engines.rollout.hf_rollout import checkpoint_tensors
from engines.rollout.images import is_vision_language


def expected_hf_tensor_shapes(model_dir) -> tuple[dict[str, tuple[int, ...]], set[str]]:
    """The tensors of the Hugging Face model in `model_dir` under its checkpoint names (what SGLang
    and the hf engine load), with their shapes, and the names every sync must carry (a tied
    weight's second name, e.g. `lm_head.weight`, is optional). Built from config.json on the meta
    device: nothing is allocated or read but the config. Kept per directory for the process: once
    vLLM's Transformers backend has built a model here (a vision-language model on CPU,
    engines/rollout/vllm_images.py), it has decorated transformers' decoder class in place for its
    compiler (vllm/model_executor/models/transformers/base.py, `_decorate_for_torch_compile`), and
    that class is then built only inside a vLLM engine; the engine reads the shapes before it starts."""
    model_dir = Path(model_dir).resolve()
    expected, required = _shapes(model_dir, (model_dir / "config.json").stat().st_mtime_ns)
    return dict(expected), set(required)


@cache
def _shapes(model_dir: Path, config_mtime_ns: int) -> tuple[dict[str, tuple[int, ...]], set[str]]:
    """`expected_hf_tensor_shapes` computed; the config's modification time keys a rewritten one apart."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    config = AutoConfig.from_pretrained(model_dir)
    auto = AutoModelForImageTextToText if is_vision_language(config) else AutoModelForCausalLM
    with torch.device("meta"):
        model = auto.from_config(config)
    every = checkpoint_tensors(model, remove_duplicate=False)
    return {name: tuple(t.shape) for name, t in every.items()}, set(checkpoint_tensors(model))
