"""Installs the `hybridflow` (controller, trainer) and `engines` (Megatron-Core, rollout) packages."""

from pathlib import Path

from setuptools import find_packages, setup


def _pinned_requirements() -> list[str]:
    lines = Path(__file__).with_name("requirements.txt").read_text().splitlines()
    return [line for line in lines if line and not line.startswith("#")]


setup(
    name="hybridflow",
    version="0.1.0",
    description="RL post-training for LLMs: a single controller over Megatron-Core workers on Ray",
    python_requires=">=3.11",
    packages=find_packages(include=["hybridflow", "hybridflow.*", "engines", "engines.*"]),
    install_requires=_pinned_requirements(),
    extras_require={
        # GPU-only engines; never needed on CPU machines.
        "sglang": ["sglang>=0.5"],
        "transformer-engine": ["transformer-engine[pytorch]"],
    },
)
