"""Installs the `hybridflow` (controller, trainer) and `engines` (Megatron-Core, rollout) packages."""

from pathlib import Path

from setuptools import find_packages, setup


def _pins(filename: str) -> list[str]:
    """The requirement lines of a pin file, without comments and `-r` includes."""
    lines = Path(__file__).with_name(filename).read_text().splitlines()
    return [line for line in lines if line and not line.startswith(("#", "-r"))]


setup(
    name="hybridflow",
    version="0.1.0",
    description="RL post-training for LLMs: a single controller over Megatron-Core workers on Ray",
    python_requires=">=3.11",
    packages=find_packages(include=["hybridflow", "hybridflow.*", "engines", "engines.*"]),
    # torch, transformers, tokenizers and numpy differ between CPU and GPU machines: their pins live
    # in requirements.txt (CPU) and requirements-gpu.txt (GPU), installed alongside this package.
    install_requires=[*_pins("requirements-common.txt"), "torch", "transformers", "tokenizers", "numpy"],
    # `.[gpu]` is requirements-gpu.txt (SGLang 0.5.23 and the torch it pins, Transformer Engine's
    # core); Transformer Engine's torch extension is built afterwards (README, "GPU machines").
    extras_require={"gpu": _pins("requirements-gpu.txt")},
)
