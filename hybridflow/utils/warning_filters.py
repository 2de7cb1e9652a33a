"""Third-party warnings known to be harmless here, silenced in one place.

`install()` runs in every worker process before its roles import an engine (the worker group's
process setup) and in the driver, so that a normal run prints hybridflow's own lines and progress
and nothing else. Each entry says what the warning is about and why it does not apply; any warning
not listed, and every warning of hybridflow's own, still prints. Seen in a quickstart run on the
pinned versions (Megatron-Core 0.16.1, torch 2.13 on CPU, vLLM 0.32.0); torch itself warned
about nothing there. vLLM's own logging is set to ERROR where its engine starts.
"""

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass(frozen=True)
class KnownWarning:
    message: str  # regular expression matched against the start of the warning's text
    module: str  # regular expression matched against the start of the warning module's name
    why: str  # why it is harmless for hybridflow
    only_without_cuda: bool = False  # harmless on CPU machines only: GPU runs still show it
    category: type[Warning] = UserWarning


KNOWN_HARMLESS = (
    KnownWarning(
        r"Transformer Engine and Apex are not installed",
        r"megatron",  # megatron.core.* and the megatron_fsdp package it vendors
        "Megatron-Core falls back to its torch implementations (multi_tensor_applier, optimizers, "
        "clipping) when neither is installed, as on every CPU machine; engines/megatron/model.py "
        "(model_kernels) picks the kernels hybridflow uses itself and says which",
    ),
    KnownWarning(
        r"Apex is not installed\. Falling back to Torch Norm",
        r"megatron",
        "hybridflow never builds Apex's norms: model_kernels chooses Transformer Engine's or torch's",
    ),
    KnownWarning(
        r"full scope is deprecated",
        r"megatron\.core\.transformer\.transformer_config",
        "TransformerConfig warns about its own default (cuda_graph_scope='full') on every config it "
        "builds; hybridflow captures no CUDA graphs",
    ),
    KnownWarning(
        r"When using async grad allreduce it is recommended to set the environment variable "
        r"CUDA_DEVICE_MAX_CONNECTIONS",
        r"megatron\.core\.tensor_parallel\.layers",
        "a speed hint about ordering CUDA streams; a CPU run has none (on GPUs it stays visible)",
        only_without_cuda=True,
    ),
    KnownWarning(
        r"`torch\.distributed\.reduce_op` is deprecated",
        r"vllm\.triton_utils\.dispatcher",
        "vLLM's kernel dispatcher looks at every attribute of the modules it scans when its engine "
        "starts, torch's deprecated alias included; neither vLLM nor hybridflow uses the alias",
        category=FutureWarning,
    ),
)


def install(cuda_available: bool | None = None) -> None:
    """Ignore each KNOWN_HARMLESS warning in this process (those `only_without_cuda` only when
    CUDA is not available)."""
    if cuda_available is None:
        import torch

        cuda_available = torch.cuda.is_available()
    for known in KNOWN_HARMLESS:
        if not (known.only_without_cuda and cuda_available):
            warnings.filterwarnings("ignore", known.message, known.category, known.module)


@contextmanager
def known_warnings_ignored() -> Iterator[None]:
    """`install()` for the duration of a block (code that imports an engine outside a run)."""
    with warnings.catch_warnings():
        install()
        yield
