"""`Worker`: the base class of every role worker (actor, rollout, critic, reward model, ...).

A worker group starts one process per slot and sets the SPMD environment before the worker
class is built: `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`,
`MASTER_PORT`. So `torch.distributed.init_process_group(backend)` works inside a worker without
arguments. `MASTER_ADDR:MASTER_PORT` is a store that rank 0's process already hosts
(`host_rendezvous`), not a port found free and left for rank 0 to bind later.

After building its Megatron model a role calls `set_parallel_ranks(ranks)`; the MEGATRON_*
dispatch modes read that layout once per worker group.
"""

from __future__ import annotations

import os
import sys

from hybridflow.parallel_ranks import ParallelRanks

# The Worker attribute holding the store its process hosts for the group (rank 0), for the worker's life.
RENDEZVOUS_ATTR = "_hf_rendezvous_store"


class Worker:
    """Base class for role workers run by `RayWorkerGroup` or `LocalWorkerGroup`.

    Subclasses expose methods decorated with `@register(dispatch_mode=...)`; the worker group
    turns each into a driver-side method. Subclasses need not call `super().__init__()`.

    Properties: `rank`, `world_size`, `local_rank`, `master_addr`, `master_port` (read from the
    environment), `parallel_ranks` (None until `set_parallel_ranks` is called).

    On GPU, Ray gives each worker process exactly its own device (`CUDA_VISIBLE_DEVICES`), so the
    worker's device is `cuda:0` in that process whatever its `LOCAL_RANK` (the slot index on its
    node); `engines.placement` makes that choice for the engines.
    """

    @property
    def rank(self) -> int:
        return int(_spmd_env("RANK"))

    @property
    def world_size(self) -> int:
        return int(_spmd_env("WORLD_SIZE"))

    @property
    def local_rank(self) -> int:
        return int(_spmd_env("LOCAL_RANK"))

    @property
    def master_addr(self) -> str:
        return _spmd_env("MASTER_ADDR")

    @property
    def master_port(self) -> int:
        return int(_spmd_env("MASTER_PORT"))

    @property
    def parallel_ranks(self) -> ParallelRanks | None:
        """This process's Megatron layout, once `set_parallel_ranks` was called."""
        return getattr(self, "_parallel_ranks", None)

    def set_parallel_ranks(self, ranks: ParallelRanks) -> None:
        """Record this process's data/tensor/pipeline/context-parallel ranks and sizes.

        Call it after Megatron's parallel state is initialised (with what
        `engines.megatron.parallel.init_megatron()` returns), in a method the driver calls before
        the first MEGATRON_* method. The worker group validates the whole layout when it reads it.
        """
        if not isinstance(ranks, ParallelRanks):
            raise TypeError(f"set_parallel_ranks expects a ParallelRanks, got {type(ranks).__name__}")
        self._parallel_ranks = ranks

    def _hf_parallel_ranks(self, role: str | None = None) -> ParallelRanks | None:
        """What the worker group reads for MEGATRON_* dispatch (`role` is for colocated classes)."""
        return self.parallel_ranks

    def teardown(self) -> None:
        """Stop what this worker started beyond its own memory (e.g. a rollout engine's processes).

        The worker group's `shutdown()` calls it on every rank before ending the processes;
        override it in a role that starts processes. The default does nothing.
        """


class RayClassWithInitArgs:
    """A `Worker` subclass and the arguments to build it with, in every slot of a worker group.

    Pass the plain class, not a `ray.remote`-decorated one: the worker group adds the Ray
    options (placement, resources, environment) itself, and `actor_options` (e.g.
    `max_concurrency`, for a worker that takes calls while others run) when a role asks for them
    with `with_actor_options`. Needs no Ray (LocalWorkerGroup takes it and runs calls one by one).
    """

    def __init__(self, cls: type, *args, **kwargs):
        ray_actor = sys.modules.get("ray.actor")  # Ray not imported: no decorated class can exist
        if ray_actor is not None and isinstance(cls, ray_actor.ActorClass):
            raise TypeError(
                "RayClassWithInitArgs takes the plain worker class, not a @ray.remote-decorated one"
            )
        if not (isinstance(cls, type) and issubclass(cls, Worker)):
            raise TypeError(f"RayClassWithInitArgs needs a subclass of Worker, got {cls!r}")
        self.cls = cls
        self.args = args
        self.kwargs = kwargs
        self.actor_options: dict = {}

    def with_actor_options(self, **options) -> RayClassWithInitArgs:
        """These Ray actor options on every actor of the class; returns self."""
        self.actor_options = options
        return self

    def instantiate(self) -> Worker:
        """Build the worker in this process (the SPMD environment must already be set)."""
        return self.cls(*self.args, **self.kwargs)


def overrides_teardown(worker_cls: type) -> bool:
    """Whether `worker_cls` has a teardown of its own (the worker group skips the call otherwise)."""
    return worker_cls.teardown is not Worker.teardown


def host_rendezvous(host: str):
    """A torch.distributed store hosted by this process, listening on a port the OS gave it (`.port`).

    Rank 0's process calls it and publishes `host` and the port as MASTER_ADDR / MASTER_PORT.
    torch's env:// rendezvous (init_process_group, and so Megatron-Core's) hosts rank 0's store
    multi-tenant, so on rank 0 it reuses this server instead of binding the port again: the port
    is held from its choice to its use. (A port found free and closed again can be taken by another
    process before rank 0 binds it: EADDRINUSE on rank 0, the other ranks talking to a stranger.)
    Keep the returned store while a rendezvous may still come (the worker holds it, `RENDEZVOUS_ATTR`).
    """
    from torch.distributed import TCPStore  # only the hosting process needs torch.distributed

    return TCPStore(host, 0, is_master=True, wait_for_workers=False, multi_tenant=True)


def _spmd_env(key: str) -> str:
    if key not in os.environ:
        raise RuntimeError(
            f"environment variable {key} is not set: a Worker reads the SPMD environment its worker "
            "group sets; build workers through RayWorkerGroup or LocalWorkerGroup"
        )
    return os.environ[key]
