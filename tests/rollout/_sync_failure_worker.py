"""Worker for test_sync_rank_failure.py: run under torchrun on 2 gloo processes (actor TP2).

    python -m torch.distributed.run --nproc_per_node 2 tests/rollout/_sync_failure_worker.py HF_DIR

Rank 1's hf engine raises a plain RuntimeError (as an out-of-memory error would) while loading the
first bucket of a colocated sync of several buckets; rank 0's loads fine. Each rank prints
"RANK <r> <error type>: <message>" for the error its sync raised, or "RANK <r> synced".
"""

import os
import sys
from pathlib import Path

import torch.distributed as dist

from engines.megatron.build import build_model
from engines.megatron.config import MegatronConfig
from engines.megatron.model import unwrap_model
from engines.megatron.parallel import init_megatron
from engines.rollout.config import RolloutConfig
from engines.rollout.hf_rollout import HFRolloutEngine
from engines.rollout.sharding_manager import MegatronRolloutShardingManager


class OutOfMemoryEngine(HFRolloutEngine):
    """The hf engine, but its first bucket's load fails with a generic error."""

    def update_weights(self, named_tensors):
        raise RuntimeError("out of memory loading the bucket (test)")


def report(line: str) -> None:
    """One write per line: both ranks share torchrun's stdout pipe, and print() writes the text and
    its newline separately, so two ranks' lines could run together."""
    os.write(sys.stdout.fileno(), (line + "\n").encode())


def main(hf_dir: Path) -> None:
    megatron_cfg = MegatronConfig(tensor_model_parallel_size=2)
    init_megatron(megatron_cfg)
    chunks = build_model(hf_dir, megatron_cfg, for_training=False)
    hf_config = unwrap_model(chunks[0]).hf_config
    cfg = RolloutConfig(weight_sync_bucket_mb=1)  # several buckets: peers go on streaming after bucket 0
    rank = dist.get_rank()
    engine = (OutOfMemoryEngine if rank == 1 else HFRolloutEngine)(hf_dir, cfg, device="cpu")
    manager = MegatronRolloutShardingManager(chunks, hf_config, engine, cfg)
    try:
        stats = manager.load_weights()
        report(f"RANK {rank} synced {stats.tensors} tensors")
    except Exception as err:
        report(f"RANK {rank} {type(err).__name__}: {err}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
