"""The single controller: one driver process runs worker roles SPMD through worker groups.

`Worker` (role base class), `register` / `Dispatch` / `Execute` (how a driver call is split over
ranks and merged back), `RayResourcePool` / `ResourcePoolManager` / `Role` (placement),
`RayClassWithInitArgs` / `RayWorkerGroup` (Ray actors per slot), `create_colocated_worker_cls`
(several roles per process), `LocalWorkerGroup` (world size 1 in the driver, no Ray: importing
this package imports Ray only when a Ray-backed name is first used).
"""

import importlib

from hybridflow.parallel_ranks import ParallelRanks
from hybridflow.single_controller.colocate import create_colocated_worker_cls
from hybridflow.single_controller.decorator import Dispatch, Execute, register
from hybridflow.single_controller.errors import UnregisteredMethodError, WorkerError
from hybridflow.single_controller.local_worker_group import LocalWorkerGroup
from hybridflow.single_controller.worker import RayClassWithInitArgs, Worker
from hybridflow.single_controller.worker_group import WorkerGroup

# Imported on first use, so that the in-process path (LocalWorkerGroup, the worker classes) runs on
# machines without Ray (scripts/gpu_check.sh).
_RAY_BACKED = {
    "RayWorkerGroup": "hybridflow.single_controller.ray_worker_group",
    "RayResourcePool": "hybridflow.single_controller.resource_pool",
    "ResourcePoolManager": "hybridflow.single_controller.resource_pool",
    "Role": "hybridflow.single_controller.resource_pool",
}


def __getattr__(name: str):
    if name in _RAY_BACKED:
        return getattr(importlib.import_module(_RAY_BACKED[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "Dispatch",
    "Execute",
    "LocalWorkerGroup",
    "ParallelRanks",
    "RayClassWithInitArgs",
    "RayResourcePool",
    "RayWorkerGroup",
    "ResourcePoolManager",
    "Role",
    "UnregisteredMethodError",
    "Worker",
    "WorkerError",
    "WorkerGroup",
    "create_colocated_worker_cls",
    "register",
]
