"""`WorkerGroup`: the backend-independent half of a worker group.

For each `@register`-ed method of the worker class it builds a driver-side method that runs
dispatch -> execute on the ranks -> (wait) -> collect -> strip auto-padding. Backends
(`RayWorkerGroup`, `LocalWorkerGroup`) supply only how to run a method on ranks and wait for it,
so a single-process debug run goes through the same dispatch and collect code as a Ray run.
"""

from __future__ import annotations

import functools

from hybridflow.parallel_ranks import ParallelRanks
from hybridflow.single_controller.decorator import Execute, MethodSpec, registered_methods
from hybridflow.single_controller.dispatch import BUILTIN, Dispatched, remove_padding
from hybridflow.single_controller.errors import UnregisteredMethodError
from hybridflow.single_controller.worker import Worker


class WorkerGroup:
    """Driver-side handle on `world_size` workers of one class (or one role of a colocated class).

    Subclasses implement `world_size`, `_execute`, `_wait` and `_query_parallel_ranks`.
    `prefix` selects a role of a colocated class: only methods named `<prefix>_<name>` are bound,
    under `<name>`.
    """

    def __init__(self, worker_cls: type, prefix: str | None = None):
        if not (isinstance(worker_cls, type) and issubclass(worker_cls, Worker)):
            raise TypeError(
                f"worker classes must subclass hybridflow.single_controller.Worker, got {worker_cls!r}"
            )
        self._worker_cls = worker_cls
        self._prefix = prefix
        self._layout: list[ParallelRanks] | None = None
        self._bind_registered_methods()

    # ------------------------------------------------------------------ backend interface
    @property
    def world_size(self) -> int:
        raise NotImplementedError

    def _execute(self, method: str, ranks: list[int], dispatched: Dispatched) -> list:
        """Start `method` on each of `ranks` with its arguments; return one handle per rank."""
        raise NotImplementedError

    def _wait(self, handles: list, ranks: list[int], method: str) -> list:
        """Block until every handle is done; return the values, raising the first failure."""
        raise NotImplementedError

    def _query_parallel_ranks(self, role: str | None) -> list[ParallelRanks | None]:
        raise NotImplementedError

    # ------------------------------------------------------------------ layout for MEGATRON_* modes
    def parallel_layout(self) -> list[ParallelRanks]:
        """Every rank's `ParallelRanks`, read from the workers at the first MEGATRON_* call, then cached."""
        if self._layout is None:
            layout = self._query_parallel_ranks(self._prefix)
            self._layout = validate_layout(layout, self.world_size, self._worker_cls.__name__)
        return self._layout

    # ------------------------------------------------------------------ method binding
    def _bind_registered_methods(self) -> None:
        for remote_name, spec in registered_methods(self._worker_cls).items():
            public_name = self._public_name(remote_name)
            if public_name is None:
                continue
            if hasattr(type(self), public_name) or public_name in vars(self):
                raise ValueError(
                    f"{self._worker_cls.__name__}.{remote_name} would shadow the worker group's own "
                    f"attribute `{public_name}`; rename the method"
                )
            setattr(self, public_name, self._make_driver_method(remote_name, public_name, spec))

    def _public_name(self, remote_name: str) -> str | None:
        if self._prefix is None:
            return remote_name
        head = f"{self._prefix}_"
        return remote_name[len(head) :] if remote_name.startswith(head) else None

    def _make_driver_method(self, remote_name: str, public_name: str, spec: MethodSpec):
        worker_method = getattr(self._worker_cls, remote_name)

        @functools.wraps(worker_method)
        def driver_method(*args, **kwargs):
            return self._call(remote_name, spec, args, kwargs)

        driver_method.__name__ = public_name
        return driver_method

    def _call(self, method: str, spec: MethodSpec, args: tuple, kwargs: dict):
        dispatch_fn, collect_fn = _dispatch_pair(spec)
        dispatched = dispatch_fn(self, *args, **kwargs)
        if not isinstance(dispatched, Dispatched):
            dispatched = _from_custom_dispatch(dispatched, method)
        ranks = list(range(self.world_size))
        if spec.execute_mode is Execute.RANK_ZERO:
            ranks = [0]
            dispatched = Dispatched(
                tuple(arg[:1] for arg in dispatched.args), {k: v[:1] for k, v in dispatched.kwargs.items()}
            )
        _check_dispatched_lengths(dispatched, len(ranks), method)
        handles = self._execute(method, ranks, dispatched)
        outputs = self._wait(handles, ranks, method) if spec.blocking else handles
        if spec.execute_mode is Execute.RANK_ZERO:
            return outputs[0]
        return remove_padding(collect_fn(self, outputs), dispatched.padding)

    def __getattr__(self, name: str):
        # Only reached for names that are not bound methods: say why a worker method is missing.
        remote_name = name if self._prefix is None else f"{self._prefix}_{name}"
        worker_cls = self.__dict__.get("_worker_cls")
        if worker_cls is not None and callable(getattr(worker_cls, remote_name, None)):
            raise UnregisteredMethodError(
                f"{worker_cls.__name__}.{remote_name} is not decorated with @register(dispatch_mode=...); "
                "only @register-ed methods can be called through a worker group"
            )
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")


def validate_layout(
    layout: list[ParallelRanks | None], world_size: int, cls_name: str
) -> list[ParallelRanks]:
    """Check every rank registered ranks, sizes agree and multiply to the world size, no duplicates."""
    missing = [rank for rank, ranks in enumerate(layout) if ranks is None]
    if missing:
        raise RuntimeError(
            f"MEGATRON_* dispatch needs each {cls_name} rank's parallel ranks, but ranks {missing} "
            "have not called self.set_parallel_ranks(...); call it (e.g. in init_model) before the "
            "first MEGATRON_* method"
        )
    sizes = {(r.dp_size, r.tp_size, r.pp_size, r.cp_size) for r in layout}
    if len(sizes) != 1:
        raise ValueError(f"{cls_name} ranks disagree on (dp, tp, pp, cp) sizes: {sorted(sizes)}")
    dp, tp, pp, cp = sizes.pop()
    if dp * tp * pp * cp != world_size:
        raise ValueError(
            f"{cls_name} parallel sizes dp={dp} x tp={tp} x pp={pp} x cp={cp} = {dp * tp * pp * cp} "
            f"do not match the world size {world_size}"
        )
    coordinates = [(r.dp, r.tp, r.pp, r.cp) for r in layout]
    if len(set(coordinates)) != len(coordinates):
        raise ValueError(f"{cls_name} ranks registered duplicate (dp, tp, pp, cp) coordinates: {coordinates}")
    return list(layout)


def _dispatch_pair(spec: MethodSpec):
    if spec.dispatch_mode is None:
        return spec.dispatch_fn, spec.collect_fn
    return BUILTIN[spec.dispatch_mode]


def _from_custom_dispatch(result, method: str) -> Dispatched:
    if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], dict)):
        raise TypeError(
            f"the custom dispatch_fn of `{method}` must return (args, kwargs), got {type(result)}"
        )
    return Dispatched(tuple(result[0]), result[1])


def _check_dispatched_lengths(dispatched: Dispatched, n_ranks: int, method: str) -> None:
    lists = list(dispatched.args) + list(dispatched.kwargs.values())
    for value in lists:
        if not isinstance(value, list | tuple) or len(value) != n_ranks:
            got = f"length {len(value)}" if isinstance(value, list | tuple) else f"a {type(value).__name__}"
            raise ValueError(
                f"dispatch of `{method}` must give a list with one item per rank ({n_ranks}), got {got}"
            )
