"""Reading a Hugging Face directory's tensors back, for tests that compare weights."""

from pathlib import Path

import torch
from safetensors.torch import load_file


def load_hf_tensors(hf_dir: Path | str) -> dict[str, torch.Tensor]:
    """Every tensor of the directory's safetensors files, whatever its sharding; fails when it
    holds none (a comparison of two empty dicts would pass)."""
    files = sorted(Path(hf_dir).glob("*.safetensors"))
    assert files, f"no safetensors files in {hf_dir}"
    return {name: tensor for path in files for name, tensor in load_file(path).items()}
