"""What every Megatron-backed role does first: initialise Megatron's parallel state and tell the
worker group this process's place in it (the MEGATRON_* dispatch modes read it)."""

from engines.megatron.config import MegatronConfig
from hybridflow.single_controller import Worker


def init_parallel_state(worker: Worker, megatron: MegatronConfig) -> None:
    """`init_megatron` (idempotent for colocated roles sharing one layout), then
    `worker.set_parallel_ranks` with the `ParallelRanks` it returns."""
    from engines.megatron.parallel import init_megatron

    worker.set_parallel_ranks(init_megatron(megatron))
