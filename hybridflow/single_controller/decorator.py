"""`@register`: marks a worker method for a worker group, with how its calls are split and merged.

    class Critic(Worker):
        @register(dispatch_mode=Dispatch.MEGATRON_COMPUTE_PROTO)
        def compute_values(self, data: DataProto) -> DataProto: ...

The worker group reads the mark and builds a driver-side `compute_values(data)` that splits
`data` by data-parallel rank, runs every worker, and concatenates the results. The dispatch and
collect functions live in `dispatch.py`; here are the enums and the decorator. On the worker
side the decorator resolves `DataProtoFuture` arguments (`materialize_futures`) and adds the
rank and method to any exception it raises.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from hybridflow.protocol import DataProtoFuture

_SPEC_ATTR = "_hybridflow_register_spec"


class Dispatch(Enum):
    """How one driver call becomes per-rank calls, and how results come back (see dispatch.py)."""

    ONE_TO_ALL = "one_to_all"
    ALL_TO_ALL = "all_to_all"
    RANK_ZERO = "rank_zero"
    DP_COMPUTE = "dp_compute"
    DP_COMPUTE_PROTO = "dp_compute_proto"
    DP_COMPUTE_PROTO_WITH_FUNC = "dp_compute_proto_with_func"
    DP_COMPUTE_METRIC = "dp_compute_metric"
    MEGATRON_COMPUTE = "megatron_compute"
    MEGATRON_COMPUTE_PROTO = "megatron_compute_proto"
    MEGATRON_PP_AS_DP_PROTO = "megatron_pp_as_dp_proto"


class Execute(Enum):
    """Which ranks run: every rank, or rank 0 only (its result is returned as is, uncollected)."""

    ALL = "all"
    RANK_ZERO = "rank_zero"


@dataclass(frozen=True)
class MethodSpec:
    """What `@register` recorded about one worker method."""

    dispatch_mode: Dispatch | None
    dispatch_fn: Callable | None  # custom pair, when dispatch_mode is None
    collect_fn: Callable | None
    execute_mode: Execute
    blocking: bool
    materialize_futures: bool


def register(
    dispatch_mode: Dispatch | dict = Dispatch.ALL_TO_ALL,
    execute_mode: Execute | None = None,
    blocking: bool = True,
    materialize_futures: bool = True,
) -> Callable:
    """Mark a `Worker` method for worker groups.

    Args:
        dispatch_mode: a `Dispatch` member, or a custom pair `{"dispatch_fn": f, "collect_fn": g}`
            with `f(worker_group, *args, **kwargs) -> (args, kwargs)` where every value is a
            list with one entry per rank, and `g(worker_group, outputs: list) -> result` (outputs
            are values when blocking, Ray object refs otherwise).
        execute_mode: `Execute.ALL` (default) or `Execute.RANK_ZERO` (implied by, and the only
            mode allowed with, `Dispatch.RANK_ZERO`).
        blocking: if False the driver call returns without waiting: a `DataProtoFuture` for the
            *_PROTO modes, otherwise the raw per-rank object refs (collected as the mode says).
        materialize_futures: resolve `DataProtoFuture` arguments on the worker before calling,
            so one call's non-blocking output feeds the next without visiting the driver.
    """
    dispatch_fn, collect_fn, mode = _check_dispatch_mode(dispatch_mode)
    execute_mode = _resolve_execute_mode(mode, execute_mode)
    spec = MethodSpec(mode, dispatch_fn, collect_fn, execute_mode, bool(blocking), bool(materialize_futures))

    def decorator(method: Callable) -> Callable:
        @functools.wraps(method)
        def on_worker(self, *args, **kwargs):
            if spec.materialize_futures:
                args = tuple(_materialize(arg) for arg in args)
                kwargs = {key: _materialize(value) for key, value in kwargs.items()}
            try:
                return method(self, *args, **kwargs)
            except Exception as err:
                err.add_note(
                    f"hybridflow: raised on rank {getattr(self, 'rank', '?')} in `{method.__name__}`"
                )
                raise

        setattr(on_worker, _SPEC_ATTR, spec)
        return on_worker

    return decorator


def method_spec(attribute) -> MethodSpec | None:
    """The `MethodSpec` of a `@register`-ed function, else None."""
    return getattr(attribute, _SPEC_ATTR, None)


def mark_registered(function: Callable, spec: MethodSpec) -> Callable:
    """Give `function` the same mark as a `@register`-ed method (used for colocated classes)."""
    setattr(function, _SPEC_ATTR, spec)
    return function


def registered_methods(cls: type) -> dict[str, MethodSpec]:
    """Name -> spec for every `@register`-ed method of `cls` (inherited ones included)."""
    specs = {}
    for name in dir(cls):
        spec = method_spec(getattr(cls, name, None))
        if spec is not None:
            specs[name] = spec
    return specs


def _materialize(value):
    return value.get() if isinstance(value, DataProtoFuture) else value


def _check_dispatch_mode(dispatch_mode) -> tuple[Callable | None, Callable | None, Dispatch | None]:
    if isinstance(dispatch_mode, Dispatch):
        return None, None, dispatch_mode
    if isinstance(dispatch_mode, dict):
        if set(dispatch_mode) != {"dispatch_fn", "collect_fn"}:
            raise ValueError(
                "a custom dispatch_mode must be a dict with exactly the keys 'dispatch_fn' and "
                f"'collect_fn', got keys {sorted(dispatch_mode)}"
            )
        for key, fn in dispatch_mode.items():
            if not callable(fn):
                raise TypeError(f"custom dispatch_mode[{key!r}] must be callable, got {type(fn).__name__}")
        return dispatch_mode["dispatch_fn"], dispatch_mode["collect_fn"], None
    raise TypeError(
        f"dispatch_mode must be a Dispatch member or a dict with 'dispatch_fn' and 'collect_fn', "
        f"got {dispatch_mode!r}"
    )


def _resolve_execute_mode(mode: Dispatch | None, execute_mode: Execute | None) -> Execute:
    if execute_mode is not None and not isinstance(execute_mode, Execute):
        raise TypeError(f"execute_mode must be an Execute member, got {execute_mode!r}")
    if mode is Dispatch.RANK_ZERO:
        if execute_mode is Execute.ALL:
            raise ValueError("Dispatch.RANK_ZERO runs on rank 0 only; it cannot use execute_mode=Execute.ALL")
        return Execute.RANK_ZERO
    return execute_mode or Execute.ALL
