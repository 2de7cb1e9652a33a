"""`LocalWorkerGroup`: the worker-group interface with world size 1 in the driver process, no Ray.

For single-device runs and for stepping through an RL step in a debugger: calls go through the
same dispatch and collect functions as `RayWorkerGroup`, then straight into the worker object,
so a breakpoint in a worker method is hit in the driver and exceptions propagate unchanged.

Differences from Ray, by design: arguments are passed by reference (a method that mutates its
input mutates the caller's object), and a non-blocking method returns its collected value
(a DataProto, not a DataProtoFuture), which the next call accepts the same way.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

from hybridflow.parallel_ranks import ParallelRanks
from hybridflow.single_controller.dispatch import Dispatched
from hybridflow.single_controller.worker import RENDEZVOUS_ATTR, RayClassWithInitArgs, Worker, host_rendezvous
from hybridflow.single_controller.worker_group import WorkerGroup

if TYPE_CHECKING:
    from hybridflow.single_controller.resource_pool import RayResourcePool


class LocalWorkerGroup(WorkerGroup):
    """One in-process worker (rank 0 of 1) with driver-side `@register`-ed methods.

    Args:
        resource_pool: optional, for symmetry with `RayWorkerGroup`; if given it must have
            world size 1 (its placement groups are not used).
        ray_cls_with_init: the worker class and its constructor arguments.

    Sets `RANK=0`, `WORLD_SIZE=1`, `LOCAL_RANK=0`, `LOCAL_WORLD_SIZE=1`, `MASTER_ADDR=127.0.0.1`
    and `MASTER_PORT` (the port of a store this process hosts from now on, `worker.host_rendezvous`)
    in this process's environment before building the worker, so
    `torch.distributed.init_process_group` works in it.
    """

    def __init__(
        self,
        resource_pool: RayResourcePool | None = None,
        ray_cls_with_init: RayClassWithInitArgs | None = None,
    ):
        if not isinstance(ray_cls_with_init, RayClassWithInitArgs):
            raise TypeError(
                f"ray_cls_with_init must be a RayClassWithInitArgs, got {type(ray_cls_with_init).__name__}"
            )
        if resource_pool is not None and resource_pool.world_size != 1:
            raise ValueError(
                f"LocalWorkerGroup runs one worker in this process; the resource pool has world size "
                f"{resource_pool.world_size} ({resource_pool.process_on_nodes}); use RayWorkerGroup"
            )
        super().__init__(ray_cls_with_init.cls)
        store = host_rendezvous("127.0.0.1")
        os.environ.update(
            {
                "RANK": "0",
                "WORLD_SIZE": "1",
                "LOCAL_RANK": "0",
                "LOCAL_WORLD_SIZE": "1",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(store.port),
            }
        )
        self._workers = [ray_cls_with_init.instantiate()]
        setattr(self.worker, RENDEZVOUS_ATTR, store)

    @classmethod
    def _view(cls, workers: list[Worker], worker_cls: type, prefix: str) -> LocalWorkerGroup:
        view = cls.__new__(cls)
        view._workers = workers
        WorkerGroup.__init__(view, worker_cls, prefix)
        return view

    @property
    def world_size(self) -> int:
        return 1

    @property
    def worker(self) -> Worker:
        """The worker object itself (for inspection in a debugger or a test)."""
        return self._workers[0]

    def spawn(self, prefix_set) -> dict[str, LocalWorkerGroup]:
        """Role -> view whose methods are the role's, without the `<role>_` prefix (same worker)."""
        return {prefix: self._view(self._workers, self._worker_cls, prefix) for prefix in prefix_set}

    def shutdown(self) -> None:
        """Run the worker's `teardown` (a failure is reported on stderr, not raised, so that an
        error already propagating is never hidden), then drop the worker object (its memory is
        freed once nothing else refers to it)."""
        try:
            for worker in self._workers:
                worker.teardown()
        except Exception as err:
            print(f"warning: {type(worker).__name__}.teardown failed: {err!r}", file=sys.stderr, flush=True)
        finally:
            self._workers.clear()

    def _execute(self, method: str, ranks: list[int], dispatched: Dispatched) -> list:
        return [
            getattr(self._workers[rank], method)(
                *(arg[i] for arg in dispatched.args), **{k: v[i] for k, v in dispatched.kwargs.items()}
            )
            for i, rank in enumerate(ranks)
        ]

    def _wait(self, handles: list, ranks: list[int], method: str) -> list:
        return handles

    def _query_parallel_ranks(self, role: str | None) -> list[ParallelRanks | None]:
        return [self._workers[0]._hf_parallel_ranks(role)]
