"""The CUDA and NCCL settings of a Megatron worker process: decided once, the same on every rank.

CUDA reads CUDA_DEVICE_MAX_CONNECTIONS when it creates a process's context and NCCL reads its
variables when the process makes its first communicator, so they are set before
`init_megatron`, and every rank sharing a communicator must have the same values:

- CUDA_DEVICE_MAX_CONNECTIONS=1: one hardware work queue, so a tensor-parallel collective
  launched before a GEMM is scheduled before it, which Megatron-Core's overlap of TP
  communication with GEMMs relies on (megatron/core/tensor_parallel/layers.py 655-665, and
  Transformer Engine's comm-GEMM overlap likewise). A value already in the environment is kept.
- With the sglang rollout, NCCL_CUMEM_ENABLE and NCCL_NVLS_ENABLE (and NCCL_GRAPH_MIXING_SUPPORT
  with decode context parallelism) as SGLang 0.5.23's `_set_envs_and_config` writes them into the
  process that builds an engine (sglang/srt/entrypoints/engine.py 1878-1921): set on every rank
  up front, so ranks holding an engine and ranks without one create their Megatron communicators
  with the same settings. SGLang's CUDA_DEVICE_MAX_CONNECTIONS=8 is meant for its schedulers,
  which inherit it; the engine rank puts its own value back after the engine starts
  (`engines.rollout.sglang_rollout`).

`process_env` is a plain function of the recipe's rollout settings and the environment, so CPU
tests check what every GPU rank gets; `check_env_agrees` (a collective) refuses ranks whose
values still differ, e.g. a variable exported on one node only.
"""

from collections.abc import Mapping
from typing import Any

PROCESS_ENV_KEYS = (
    "CUDA_DEVICE_MAX_CONNECTIONS",
    "NCCL_CUMEM_ENABLE",
    "NCCL_NVLS_ENABLE",
    "NCCL_GRAPH_MIXING_SUPPORT",
)


def process_env(
    rollout_name: str, sglang_args: Mapping[str, Any], environ: Mapping[str, str]
) -> dict[str, str]:
    """The variables to set in a Megatron worker process (before CUDA or NCCL start), given the
    recipe's `rollout.name` and `rollout.sglang` and the process's current environment."""
    env = {} if "CUDA_DEVICE_MAX_CONNECTIONS" in environ else {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    if rollout_name == "sglang":
        env.update(sglang_nccl_env(sglang_args, environ))
    return env


def sglang_nccl_env(sglang_args: Mapping[str, Any], environ: Mapping[str, str]) -> dict[str, str]:
    """What SGLang 0.5.23 writes into the environment of the process that builds an engine (with
    `enable_memory_saver`, which hybridflow always sets, and one node per engine)."""
    symm_mem = bool(sglang_args.get("enable_symm_mem", False))
    nvls = bool(sglang_args.get("enable_nccl_nvls", False))
    env = {}
    if "NCCL_CUMEM_ENABLE" not in environ or symm_mem:
        env["NCCL_CUMEM_ENABLE"] = str(int(symm_mem))
    if "NCCL_NVLS_ENABLE" not in environ or nvls or symm_mem:
        env["NCCL_NVLS_ENABLE"] = str(int(nvls or symm_mem))
    if ("NCCL_GRAPH_MIXING_SUPPORT" not in environ or symm_mem) and sglang_args.get("dcp_size", 1) > 1:
        env["NCCL_GRAPH_MIXING_SUPPORT"] = "0"
    return env


def differing_env(values_by_rank: list[dict[str, str | None]]) -> dict[str, list[str | None]]:
    """Key -> each rank's value, for the keys whose value is not the same on every rank."""
    keys = sorted({key for values in values_by_rank for key in values})
    return {
        key: [values.get(key) for values in values_by_rank]
        for key in keys
        if len({values.get(key) for values in values_by_rank}) > 1
    }


def check_env_agrees(environ: Mapping[str, str]) -> None:
    """Collective over the default process group: ValueError naming each variable of
    PROCESS_ENV_KEYS whose value differs between ranks."""
    import torch.distributed as dist

    mine = {key: environ.get(key) for key in PROCESS_ENV_KEYS}
    values: list[dict | None] = [None] * dist.get_world_size()
    dist.all_gather_object(values, mine)
    differing = differing_env(values)
    if differing:
        listed = "; ".join(f"{key}: {by_rank} (by rank)" for key, by_rank in differing.items())
        raise ValueError(
            f"the ranks of one Megatron group must share their CUDA/NCCL settings, but {listed}; "
            "export the same values on every node (or none: hybridflow sets them)"
        )
