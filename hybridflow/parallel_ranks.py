"""`ParallelRanks`: one process's place in the Megatron layout, shared by both sides of dispatch.

The engines report it (`engines.megatron.parallel.parallel_ranks()`), a worker records it
(`Worker.set_parallel_ranks`), and the MEGATRON_* dispatch modes read it to split data by
data-parallel rank and collect from `is_collect_rank` workers. Plain Python, so the engines and
the controller can both import it without importing each other.

`NODE_ID_ENV` is the other fact of a process's place both sides share: the worker group sets it,
`engines.placement` reads it.
"""

from dataclasses import dataclass

# Set by the worker group to the Ray node id of the worker's slot; the host name is the fallback
# (torchrun), which tells real nodes apart but not nodes simulated on one machine.
NODE_ID_ENV = "HYBRIDFLOW_NODE_ID"


@dataclass(frozen=True)
class ParallelRanks:
    """Ranks and sizes along each parallel dimension (data, tensor, pipeline, context)."""

    dp: int
    tp: int
    pp: int
    dp_size: int
    tp_size: int
    pp_size: int
    cp: int = 0
    cp_size: int = 1

    def __post_init__(self):
        for dim in ("dp", "tp", "pp", "cp"):
            rank, size = getattr(self, dim), getattr(self, f"{dim}_size")
            if not (isinstance(size, int) and size >= 1 and isinstance(rank, int) and 0 <= rank < size):
                raise ValueError(f"parallel rank {dim}={rank!r} must be an int in [0, {dim}_size={size!r})")

    @property
    def is_collect_rank(self) -> bool:
        """True on the ranks whose outputs MEGATRON_COMPUTE(_PROTO) collects: tp 0, cp 0, last pp stage."""
        return self.tp == 0 and self.cp == 0 and self.pp == self.pp_size - 1
