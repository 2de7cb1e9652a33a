"""The single controller: one driver process runs worker roles SPMD through worker groups.

`Worker` (role base class), `register` / `Dispatch` / `Execute` (how a driver call is split over
ranks and merged back), `RayResourcePool` / `ResourcePoolManager` / `Role` (placement),
`RayClassWithInitArgs` / `RayWorkerGroup` (Ray actors per slot), `create_colocated_worker_cls`
(several roles per process), `LocalWorkerGroup` (world size 1 in the driver, no Ray).
"""

from hybridflow.parallel_ranks import ParallelRanks
from hybridflow.single_controller.colocate import create_colocated_worker_cls
from hybridflow.single_controller.decorator import Dispatch, Execute, register
from hybridflow.single_controller.errors import UnregisteredMethodError, WorkerError
from hybridflow.single_controller.local_worker_group import LocalWorkerGroup
from hybridflow.single_controller.ray_worker_group import RayClassWithInitArgs, RayWorkerGroup
from hybridflow.single_controller.resource_pool import RayResourcePool, ResourcePoolManager, Role
from hybridflow.single_controller.worker import Worker
from hybridflow.single_controller.worker_group import WorkerGroup

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
