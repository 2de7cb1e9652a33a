"""What every Megatron-backed role does first: set the process's CUDA/NCCL settings, initialise
Megatron's parallel state and tell the worker group this process's place in it (the MEGATRON_*
dispatch modes read it)."""

import os

from engines.megatron.config import MegatronConfig
from engines.rollout.config import RolloutConfig
from hybridflow.single_controller import Worker


def init_parallel_state(worker: Worker, megatron: MegatronConfig, rollout: RolloutConfig) -> None:
    """`engines.process_env` settings (decided from the whole recipe, so that colocated roles and
    every rank agree), `init_megatron` (idempotent for colocated roles sharing one layout), the
    check that every rank has the same settings, then `worker.set_parallel_ranks`."""
    from engines.megatron.parallel import init_megatron
    from engines.process_env import check_env_agrees, process_env

    os.environ.update(process_env(rollout.name, rollout.sglang, os.environ))
    ranks = init_megatron(megatron)
    check_env_agrees(os.environ)
    worker.set_parallel_ranks(ranks)
