"""`RayWorkerGroup`: one Ray actor per resource-pool slot, driven SPMD from the driver.

    pool = RayResourcePool([4])
    critic = RayWorkerGroup(pool, RayClassWithInitArgs(CriticWorker, config))
    critic.init_model()                        # ONE_TO_ALL: every rank runs it
    values = critic.compute_values(batch)      # MEGATRON_COMPUTE_PROTO: split by dp, concat back

Rank r runs in slot r (slots laid out node by node) with `RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
`LOCAL_WORLD_SIZE`, `MASTER_ADDR` (rank 0's node), `MASTER_PORT` and `HYBRIDFLOW_NODE_ID` (the
slot's Ray node id, which `engines.placement` reads) in its environment before the worker class's
`__init__` runs. Rank 0's process hosts the torch.distributed store at MASTER_ADDR:MASTER_PORT
from before its `__init__` (`worker.host_rendezvous`: the OS picks the port as the store binds it)
and publishes the address; the other ranks start their `__init__` once rank 0's has returned, so
a collective belongs in a method (such as `init_model`), not in `__init__`.

Large arguments (DataProto, tensors, arrays) are put in the object store once per call however
many ranks read them. Blocking calls wait on all ranks and raise the first failure as soon as it
happens (a rank stuck in a collective with a dead peer cannot hide it), as a `WorkerError` that is
also the original exception type.

A rank whose process died can be replaced alone (`restart_rank`: a fresh actor of the same class,
arguments and environment in the same slot) and then driven alone (`call_rank`): the rollout pool
restarts a dead engine this way (hybridflow/trainer/rollout/pool.py) while the other ranks keep
theirs. `dead_ranks` says which ranks' processes are gone, `kill_rank` kills one (a hung engine).

One rank can also be called without waiting (`call_rank_async`), the calls in flight awaited in
the order they finish (`wait_calls`) and their values read (`call_result`): the streaming rollout
sends each prompt group to one rollout process this way (hybridflow/trainer/rollout/stream.py).
Nothing outside this package touches the Ray actors (tests/test_layering.py).

Every blocking call has a deadline (`call_deadline`, a `CallDeadline`: the seconds and the recipe
setting that gives them; `with group.deadline(...)` for the calls of a block): a call that passes
it raises `CallTimeout` naming the rank, the worker class, the method and the setting to raise.
The hung process is left as it is: the caller decides (the rollout pool kills and restarts a hung
engine, hybridflow/trainer/rollout/pool.py; a run stopping kills every actor in `shutdown`).
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterator

import numpy as np
import ray
import torch
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from hybridflow.parallel_ranks import NODE_ID_ENV, ParallelRanks
from hybridflow.protocol import DataProto
from hybridflow.single_controller.decorator import registered_methods
from hybridflow.single_controller.dispatch import Dispatched
from hybridflow.single_controller.errors import (
    DEFAULT_DEADLINE,
    CallDeadline,
    call_timeout,
    worker_error,
)
from hybridflow.single_controller.resource_pool import RayResourcePool
from hybridflow.single_controller.worker import (
    RENDEZVOUS_ATTR,
    RayClassWithInitArgs,
    host_rendezvous,
    overrides_teardown,
)
from hybridflow.single_controller.worker_group import WorkerGroup
from hybridflow.utils import warning_filters
from hybridflow.utils.imports import first_line

# Arguments worth one object-store copy shared by every rank that reads them.
_SHARED_TYPES = (DataProto, torch.Tensor, np.ndarray)
# How long shutdown() waits for the workers' teardown: longer than SGLang 0.5.23's own wait for its
# scheduler processes to exit (60 s, entrypoints/engine.py 1491).
TEARDOWN_TIMEOUT_S = 90.0
# How long `dead_ranks` waits for the ranks' answers: a dead process's fails at once, a rank busy in
# a call (one call at a time) answers later and counts as alive.
DEATH_CHECK_S = 2.0
# How long `kill_rank` waits for Ray to report a killed rank's process dead.
KILL_WAIT_S = 60.0
# How long a rank other than 0 waits in its start for rank 0's `__init__` to return and publish the
# store's address.
RENDEZVOUS_WAIT_S = 600.0
# The least time a worker's start (`__init__`) gets: more than a rank's wait for rank 0's.
START_WAIT_S = RENDEZVOUS_WAIT_S + 60.0


class RayWorkerGroup(WorkerGroup):
    """Ray actors of one worker class over a `RayResourcePool`, with driver-side `@register`-ed methods.

    Args:
        resource_pool: where the actors go (one per slot); its placement groups are created here
            if they do not exist yet.
        ray_cls_with_init: the worker class and its constructor arguments.

    The constructor returns once every actor finished `__init__` (a failing `__init__` raises here,
    naming the rank). `spawn(prefix_set)` gives per-role views of a colocated class;
    `shutdown()` runs each rank's `Worker.teardown`, then kills the actors.
    """

    def __init__(
        self,
        resource_pool: RayResourcePool,
        ray_cls_with_init: RayClassWithInitArgs,
        call_deadline: CallDeadline = DEFAULT_DEADLINE,
    ):
        if not isinstance(resource_pool, RayResourcePool):
            raise TypeError(f"resource_pool must be a RayResourcePool, got {type(resource_pool).__name__}")
        if not isinstance(ray_cls_with_init, RayClassWithInitArgs):
            raise TypeError(
                f"ray_cls_with_init must be a RayClassWithInitArgs, got {type(ray_cls_with_init).__name__}"
            )
        super().__init__(ray_cls_with_init.cls)
        self._pool, self._cls_with_init = resource_pool, ray_cls_with_init
        self.call_deadline = call_deadline
        self._slots = _slots(resource_pool)
        self._envs = spmd_envs(resource_pool.slot_nodes())
        self._remote_cls = ray.remote(_with_spmd_env(ray_cls_with_init.cls))
        self._actors = [self._start_actor(0)]
        self._rendezvous = self._published_by_rank_zero()
        self._actors += [self._start_actor(rank) for rank in range(1, len(self._slots))]
        try:  # rank 0 first: the other ranks' starts wait on it, so its failure is the cause of theirs
            self._wait_started([self._actors[0].__ray_ready__.remote()], [0])
            self._wait_started([actor.__ray_ready__.remote() for actor in self._actors], self._ranks())
        except BaseException:
            self._kill_actors()  # nothing started yet that a teardown would stop
            raise

    @classmethod
    def _view(cls, actors: list, worker_cls: type, prefix: str | None) -> RayWorkerGroup:
        view = cls.__new__(cls)
        view._actors = actors
        view.call_deadline = DEFAULT_DEADLINE
        WorkerGroup.__init__(view, worker_cls, prefix)
        return view

    @property
    def world_size(self) -> int:
        return len(self._actors)

    def _start_actor(self, rank: int):
        """A new actor of this group's class in rank's slot, with rank's SPMD environment; rank 0
        hosts the rendezvous store, the others meet it at the address rank 0 published."""
        pg, bundle = self._slots[rank]
        cls_with_init = self._cls_with_init
        return self._remote_cls.options(
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=bundle),
            **self._pool.actor_resources(),
            **cls_with_init.actor_options,
        ).remote(
            self._envs[rank],
            None if rank == 0 else self._rendezvous,
            *cls_with_init.args,
            **cls_with_init.kwargs,
        )

    def _published_by_rank_zero(self) -> list:
        """[a reference to rank 0's (MASTER_ADDR, MASTER_PORT)], in a list so that Ray hands the
        reference itself to the other ranks' starts (a top-level one would hold back their process
        start until rank 0's `__init__` returned)."""
        return [self._actors[0]._hf_rendezvous_address.remote()]

    def restart_rank(self, rank: int) -> None:
        """Replace rank's actor (dead, or killed here) with a fresh one in the same slot, built with
        the same arguments and environment; returns once its `__init__` ran. Nothing else runs on
        it: the caller brings it up (e.g. `call_rank(rank, "init_model")`). Views of this group
        share the new actor."""
        self.kill_rank(rank)
        self._actors[rank] = self._start_actor(rank)  # in place: the views hold the same list
        if rank == 0:  # a fresh store: ranks restarted later meet this one
            self._rendezvous = self._published_by_rank_zero()
        self._wait_started([self._actors[rank].__ray_ready__.remote()], [rank])

    def call_rank(self, rank: int, method: str, *args, **kwargs):
        """`method` of the worker class on one rank alone, blocking; its result. Raises like a group
        call (a `WorkerError` naming the rank)."""
        return self._wait([self.call_rank_async(rank, method, *args, **kwargs)], [rank], method)[0]

    def call_rank_async(self, rank: int, method: str, *args, **kwargs) -> ray.ObjectRef:
        """`method` of the worker class started on one rank alone; the call in flight at once (a
        Ray object reference, for `wait_calls` and `call_result`). No deadline: the caller bounds
        its waits."""
        if method not in registered_methods(self._worker_cls):
            raise ValueError(f"{self._worker_cls.__name__}.{method} is not a @register-ed method")
        return getattr(self._actors[rank], method).remote(*args, **kwargs)

    @staticmethod
    def wait_calls(calls: list, count: int | None = None, wait_s: float | None = None) -> list:
        """The finished ones of `calls` (from `call_rank_async`, or a non-blocking call's
        `DataProtoFuture.futures`), once `count` of them (all when None) have finished or `wait_s`
        seconds have passed (None: no limit); at most `count`."""
        return ray.wait(calls, num_returns=len(calls) if count is None else count, timeout=wait_s)[0]

    @staticmethod
    def call_result(call, rank: int, method: str):
        """A finished call's value (one of `wait_calls`'s); a `WorkerError` naming the rank and the
        method when it failed or its process died."""
        try:
            return ray.get(call)
        except ray.exceptions.RayError as err:  # task errors and dead actors alike
            raise worker_error(err, rank, method) from err

    def kill_rank(self, rank: int) -> None:
        """Kill rank's process (e.g. a hung one): its calls in flight fail as a dead process's do,
        and `restart_rank` replaces it. Returns once Ray reports the process dead to this driver,
        so that `dead_ranks` names it (Ray kills asynchronously: a busy rank's answer would only be
        late until then, and it would count as alive)."""
        actor = self._actors[rank]
        ray.kill(actor, no_restart=True)
        deadline = time.monotonic() + KILL_WAIT_S
        while time.monotonic() < deadline:
            try:
                ray.get(actor.__ray_ready__.remote(), timeout=max(deadline - time.monotonic(), 0.0))
            except ray.exceptions.RayActorError:
                return
            except ray.exceptions.GetTimeoutError:
                break
        raise TimeoutError(
            f"{self._worker_cls.__name__} rank {rank} was killed, but Ray did not report its process dead "
            f"within {KILL_WAIT_S:g}s; Ray's logs (raylet.out) say what happened to the kill"
        )

    def dead_ranks(self, wait_s: float = DEATH_CHECK_S) -> list[int]:
        """The ranks whose process died: their actor fails to answer (a rank still busy after
        `wait_s` is alive)."""
        rank_of = {actor.__ray_ready__.remote(): rank for rank, actor in enumerate(self._actors)}
        done, _ = ray.wait(list(rank_of), num_returns=len(rank_of), timeout=wait_s)
        dead = []
        for ref in done:
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError:
                dead.append(rank_of[ref])
        return sorted(dead)

    @property
    def actors(self) -> list:
        """The Ray actor handles, by rank (for tests: code outside this package drives the group
        through its methods, tests/test_layering.py)."""
        return list(self._actors)

    def spawn(self, prefix_set) -> dict[str, RayWorkerGroup]:
        """Role -> view of this group whose methods are the role's, without the `<role>_` prefix.

        Views share this group's actors (one process per slot for all roles).
        """
        views = {prefix: self._view(self._actors, self._worker_cls, prefix) for prefix in prefix_set}
        for view in views.values():
            view.call_deadline = self.call_deadline
        return views

    @contextlib.contextmanager
    def deadline(self, call_deadline: CallDeadline) -> Iterator[None]:
        """The calls of the block under `call_deadline` instead of the group's."""
        kept, self.call_deadline = self.call_deadline, call_deadline
        try:
            yield
        finally:
            self.call_deadline = kept

    def shutdown(self, teardown_timeout_s: float = TEARDOWN_TIMEOUT_S) -> None:
        """Run every rank's `Worker.teardown` (e.g. a rollout engine's `shutdown`), then kill every
        actor of this group (and so of the views spawned from it).

        Ranks get `teardown_timeout_s` in all: a rank still busy in an earlier call (e.g. waiting in
        a collective for a dead peer) cannot run its teardown and is killed when that time is up. A
        teardown that fails or does not finish is reported on stderr, not raised, so that an error
        already propagating (shutdown runs in `finally` blocks) is never hidden.
        """
        try:
            if overrides_teardown(self._worker_cls):
                self._teardown_actors(teardown_timeout_s)
        finally:
            self._kill_actors()

    def _teardown_actors(self, timeout_s: float) -> None:
        rank_of = {actor.teardown.remote(): rank for rank, actor in enumerate(self._actors)}
        done, pending = ray.wait(list(rank_of), num_returns=len(rank_of), timeout=timeout_s)
        for ref in done:
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError:
                pass  # the process is gone: nothing left to tear down, and its death was reported
            except ray.exceptions.RayError as err:
                _warn(f"rank {rank_of[ref]}: {self._worker_cls.__name__}.teardown failed: {_summary(err)}")
        for ref in pending:
            _warn(
                f"rank {rank_of[ref]}: {self._worker_cls.__name__}.teardown did not finish within "
                f"{timeout_s:g}s (busy in an earlier call?); killing the process"
            )

    def _kill_actors(self) -> None:
        for actor in self._actors:
            ray.kill(actor, no_restart=True)

    # ------------------------------------------------------------------ backend interface
    def _execute(self, method: str, ranks: list[int], dispatched: Dispatched) -> list:
        shared: dict[int, ray.ObjectRef] = {}

        def share(value):
            if not isinstance(value, _SHARED_TYPES):
                return value
            if id(value) not in shared:
                shared[id(value)] = ray.put(value)
            return shared[id(value)]

        return [
            getattr(self._actors[rank], method).remote(
                *(share(arg[i]) for arg in dispatched.args),
                **{key: share(values[i]) for key, values in dispatched.kwargs.items()},
            )
            for i, rank in enumerate(ranks)
        ]

    def _wait_started(self, handles: list, ranks: list[int]) -> None:
        """Wait for the actors' `__init__`: a process start (imports, placement) gets at least
        START_WAIT_S, however short the group's call deadline."""
        deadline = self.call_deadline
        with self.deadline(CallDeadline(max(deadline.seconds, START_WAIT_S), deadline.setting)):
            self._wait(handles, ranks, "__init__")

    def _wait(self, handles: list, ranks: list[int], method: str) -> list:
        position = {ref: i for i, ref in enumerate(handles)}
        values = [None] * len(handles)
        pending = list(handles)
        deadline = self.call_deadline
        end = time.monotonic() + deadline.seconds
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, end - time.monotonic()))
            if not ready:
                rank = ranks[position[pending[0]]]
                raise call_timeout(self._who(), rank, method, deadline)
            for ref in ready:
                i = position[ref]
                try:
                    values[i] = ray.get(ref)
                except ray.exceptions.RayError as err:  # task errors and dead actors alike
                    raise worker_error(err, ranks[i], method) from err
        return values

    def _who(self) -> str:
        """The worker class, and the role of a colocated class's view."""
        name = self._worker_cls.__name__
        return f"{name} ({self._prefix})" if self._prefix else name

    def _query_parallel_ranks(self, role: str | None) -> list[ParallelRanks | None]:
        refs = [actor._hf_parallel_ranks.remote(role) for actor in self._actors]
        return self._wait(refs, self._ranks(), "_hf_parallel_ranks")

    def _ranks(self) -> list[int]:
        return list(range(len(self._actors)))


def _summary(err: ray.exceptions.RayError) -> str:
    """One line for a warning: the worker's own exception, or the first line of Ray's (a dead
    process's text runs on for a dozen lines)."""
    return first_line(err.cause if isinstance(err, ray.exceptions.RayTaskError) else err)


def _warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr, flush=True)


def _slots(pool: RayResourcePool) -> list[tuple]:
    """(placement group, bundle index) of every rank, laid out node by node."""
    return [
        (pg, bundle)
        for pg, count in zip(pool.placement_groups(), pool.process_on_nodes, strict=True)
        for bundle in range(count)
    ]


def _with_spmd_env(cls: type) -> type:
    """`cls` whose constructor first sets the SPMD environment it is given, with the rendezvous
    address (`rendezvous` None: this rank hosts the store; else [rank 0's published address]), and
    silences the third-party warnings known to be harmless (hybridflow.utils.warning_filters)
    before any role imports an engine.

    Passing the environment as a constructor argument, rather than as a per-actor Ray
    runtime_env, lets actors start in Ray's already-running idle worker processes.
    """

    def __init__(self, spmd_env: dict[str, str], rendezvous: list | None, *args, **kwargs):
        os.environ.update(spmd_env)
        host, port = _rendezvous_address(self, rendezvous, spmd_env["RANK"])
        os.environ.update(MASTER_ADDR=host, MASTER_PORT=str(port))
        warning_filters.install()
        cls.__init__(self, *args, **kwargs)

    def _hf_rendezvous_address(self) -> tuple[str, int]:
        return self.master_addr, self.master_port

    methods = {"__init__": __init__, "_hf_rendezvous_address": _hf_rendezvous_address, "__doc__": cls.__doc__}
    return type(cls.__name__, (cls,), methods)


def _rendezvous_address(worker, rendezvous: list | None, rank: str) -> tuple[str, int]:
    """Rank 0 (`rendezvous` None) hosts the store on its node, held by `worker`; the others wait
    for the address rank 0 published (`rendezvous[0]`)."""
    if rendezvous is None:
        host = ray.util.get_node_ip_address()
        store = host_rendezvous(host)
        setattr(worker, RENDEZVOUS_ATTR, store)
        return host, store.port
    try:
        return ray.get(rendezvous[0], timeout=RENDEZVOUS_WAIT_S)
    except ray.exceptions.GetTimeoutError:
        raise TimeoutError(
            f"rank {rank} waited {RENDEZVOUS_WAIT_S:g}s for rank 0 to publish its torch.distributed "
            "store's address, which it does when its __init__ returns: is rank 0's __init__ stuck "
            "(a collective belongs in a method such as init_model)?"
        ) from None


def spmd_envs(slot_nodes: list[str]) -> list[dict[str, str]]:
    """The torch.distributed environment of every rank, given the node id of each slot, but for
    MASTER_ADDR / MASTER_PORT: rank 0's process sets them as it hosts the store (`_with_spmd_env`)."""
    envs = []
    for rank, node in enumerate(slot_nodes):
        envs.append(
            {
                "RANK": str(rank),
                "WORLD_SIZE": str(len(slot_nodes)),
                "LOCAL_RANK": str(slot_nodes[:rank].count(node)),
                "LOCAL_WORLD_SIZE": str(slot_nodes.count(node)),
                NODE_ID_ENV: node,
            }
        )
    return envs
