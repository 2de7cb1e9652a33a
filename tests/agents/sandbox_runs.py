"""What the Python sandbox tests share: the layer sets, a call of the sandbox tool on some code, and
the skip for a kernel whose Landlock is too old for a check."""

import asyncio

import pytest

from hybridflow.agents.tools import PythonSandbox
from hybridflow.agents.tools.sandbox_child import landlock_abi

ALL = ("namespaces", "landlock", "seccomp", "processes", "audit")
NO_LAYERS = ()


def run_code(code: str, **kwargs) -> str:
    return asyncio.run(PythonSandbox(**kwargs).call({"code": code}))


def needs_landlock_abi(layers: tuple, abi: int):
    if "landlock" in layers and landlock_abi() < abi:
        pytest.skip(f"this kernel's Landlock ABI is {landlock_abi()}; TCP rules need ABI >= {abi}")
