"""Overhead of one worker-group call: a no-op MEGATRON_COMPUTE_PROTO method on 4 Ray workers.

Layout dp 2 x tp 2, batch 512 x 2,048 tokens with 8 int64 tensor keys (64 MiB). Each call splits
the batch into 2 dp chunks, puts each in the object store once, runs the 4 ranks, and collects a
tiny result from the 2 tp-0 ranks. Compared with pickling the same batch once in the driver.
GB/s is the batch size over the time per call.

Run: `python -m benchmarks dispatch` (starts its own Ray unless one is already running).
"""

import pickle
import sys

import ray
import torch

from benchmarks._timing import median_seconds
from hybridflow.protocol import DataProto
from hybridflow.single_controller import (
    Dispatch,
    ParallelRanks,
    RayClassWithInitArgs,
    RayResourcePool,
    RayWorkerGroup,
    Worker,
    register,
)

TITLE = (
    "Worker-group call overhead: no-op MEGATRON_COMPUTE_PROTO, 4 workers (dp 2 x tp 2), 512 x 2048 x 8 keys"
)
ROWS, TOKENS, KEYS, REPEATS = 512, 2048, 8, 5


class NoOpWorker(Worker):
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_layout(self):
        self.set_parallel_ranks(
            ParallelRanks(dp=self.rank // 2, tp=self.rank % 2, pp=0, dp_size=2, tp_size=2, pp_size=1)
        )

    @register(dispatch_mode=Dispatch.MEGATRON_COMPUTE_PROTO)
    def no_op(self, data: DataProto) -> DataProto:
        return DataProto.from_dict({"done": torch.ones(len(data), dtype=torch.bool)})

    @register(dispatch_mode=Dispatch.MEGATRON_COMPUTE_PROTO, blocking=False)
    def no_op_later(self, data: DataProto) -> DataProto:
        return DataProto.from_dict({"done": torch.ones(len(data), dtype=torch.bool)})


ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers need not import benchmarks/


def run() -> list[dict]:
    started_here = not ray.is_initialized()
    if started_here:
        ray.init(num_cpus=4, include_dashboard=False, configure_logging=False, log_to_driver=False)
    pool = RayResourcePool([4], name_prefix="bench_dispatch")
    group = RayWorkerGroup(pool, RayClassWithInitArgs(NoOpWorker))
    try:
        group.init_layout()
        data = DataProto.from_dict({f"key{k}": torch.randint(0, 32000, (ROWS, TOKENS)) for k in range(KEYS)})
        gigabytes = sum(t.numel() * t.element_size() for t in data.batch.values()) / 1e9
        timings = {
            "pickle the batch once (protocol 5)": median_seconds(
                lambda: pickle.dumps(data, protocol=5), REPEATS
            ),
            "blocking call": median_seconds(lambda: group.no_op(data), REPEATS),
            "non-blocking call, returns a future": median_seconds(lambda: group.no_op_later(data), REPEATS),
            "non-blocking call + future.get()": median_seconds(
                lambda: group.no_op_later(data).get(), REPEATS
            ),
        }
    finally:
        group.shutdown()
        pool.release()
        if started_here:
            ray.shutdown()
    return [
        {"case": case, "ms_per_call": 1e3 * seconds, "batch_GB": gigabytes, "GB_per_s": gigabytes / seconds}
        for case, seconds in timings.items()
    ]
