"""Dispatch (driver args -> one arg list per rank) and collect (per-rank outputs -> one result).

| mode                       | dispatch                                    | collect                      |
| -------------------------- | ------------------------------------------- | ---------------------------- |
| ONE_TO_ALL                 | same args to every rank                     | list of all outputs          |
| ALL_TO_ALL, DP_COMPUTE     | world-size lists, item i -> rank i          | list                         |
| RANK_ZERO                  | args to rank 0 only                         | rank 0's output              |
| DP_COMPUTE_PROTO           | DataProtos split into world-size chunks     | concat                       |
| DP_COMPUTE_PROTO_WITH_FUNC | first arg (a function) to all, rest split   | concat                       |
| DP_COMPUTE_METRIC          | split like DP_COMPUTE_PROTO                 | list                         |
| MEGATRON_COMPUTE           | dp-size lists, item d -> all ranks of dp d  | collect ranks*, in dp order  |
| MEGATRON_COMPUTE_PROTO     | dp chunks, chunk d -> all ranks of dp d     | collect ranks*, concat       |
| MEGATRON_PP_AS_DP_PROTO    | dp*pp chunks, chunk d*pp_size+p -> (d, p)   | tp 0, cp 0 ranks, concat     |
* collect ranks: tp rank 0, cp rank 0, last pipeline stage (`ParallelRanks.is_collect_rank`).
MEGATRON_PP_AS_DP_PROTO concatenates in chunk order, so rows line up with the input.

Every *_PROTO split pads the batch (`pad_dataproto_to_divisor`) when a DataProto enables it
(`is_padding_enabled()`) and its length does not divide; the padding rows are removed after
collecting. A split of a length that does not divide, without padding enabled, is a ValueError.
A `DataProtoFuture` argument is split on the workers when they resolve it (its length is unknown
here), so it cannot be auto-padded: its length must divide.
Ranks that receive the same chunk receive the same object, so the Ray backend puts it once.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from hybridflow.protocol import DataProto, DataProtoFuture, pad_dataproto_to_divisor, unpad_dataproto
from hybridflow.single_controller.decorator import Dispatch


@dataclass
class Dispatched:
    """Per-rank arguments: `args[j][i]` is positional argument j for the i-th target rank."""

    args: tuple[list, ...]
    kwargs: dict[str, list]
    padding: int = 0  # rows added by auto-padding, removed from the collected result


# ---------------------------------------------------------------------- dispatch functions
def dispatch_one_to_all(wg, *args, **kwargs) -> Dispatched:
    n = wg.world_size
    return Dispatched(tuple([arg] * n for arg in args), {k: [v] * n for k, v in kwargs.items()})


def dispatch_rank_zero(wg, *args, **kwargs) -> Dispatched:
    return Dispatched(tuple([arg] for arg in args), {k: [v] for k, v in kwargs.items()})


def dispatch_per_rank_lists(mode: Dispatch, wg, *args, **kwargs) -> Dispatched:
    """ALL_TO_ALL / DP_COMPUTE: every argument is already a list with one item per rank."""
    _check_lists(mode, wg.world_size, "the world size", args, kwargs)
    return Dispatched(tuple(list(arg) for arg in args), {k: list(v) for k, v in kwargs.items()})


def dispatch_dp_proto(mode: Dispatch, wg, *args, **kwargs) -> Dispatched:
    """DP_COMPUTE_PROTO / DP_COMPUTE_METRIC: split every DataProto into world-size chunks."""
    return _split_protos(mode, wg.world_size, args, kwargs)


def dispatch_dp_proto_with_func(wg, func, *args, **kwargs) -> Dispatched:
    if not callable(func):
        raise TypeError(
            f"DP_COMPUTE_PROTO_WITH_FUNC expects a function as first argument, got {type(func).__name__}"
        )
    split = _split_protos(Dispatch.DP_COMPUTE_PROTO_WITH_FUNC, wg.world_size, args, kwargs)
    return Dispatched(([func] * wg.world_size, *split.args), split.kwargs, split.padding)


def dispatch_megatron(wg, *args, **kwargs) -> Dispatched:
    """MEGATRON_COMPUTE: dp-size lists; every rank of data-parallel rank d gets item d."""
    layout = wg.parallel_layout()
    _check_lists(Dispatch.MEGATRON_COMPUTE, layout[0].dp_size, "the data-parallel size", args, kwargs)
    return _select_per_rank(args, kwargs, [ranks.dp for ranks in layout], padding=0)


def dispatch_megatron_proto(wg, *args, **kwargs) -> Dispatched:
    layout = wg.parallel_layout()
    split = _split_protos(Dispatch.MEGATRON_COMPUTE_PROTO, layout[0].dp_size, args, kwargs)
    return _select_per_rank(split.args, split.kwargs, [ranks.dp for ranks in layout], split.padding)


def dispatch_megatron_pp_as_dp_proto(wg, *args, **kwargs) -> Dispatched:
    layout = wg.parallel_layout()
    chunks = layout[0].dp_size * layout[0].pp_size
    split = _split_protos(Dispatch.MEGATRON_PP_AS_DP_PROTO, chunks, args, kwargs)
    return _select_per_rank(split.args, split.kwargs, [_pp_as_dp_index(r) for r in layout], split.padding)


# ---------------------------------------------------------------------- collect functions
def collect_list(wg, outputs: list) -> list:
    return list(outputs)


def collect_concat(wg, outputs: list) -> DataProto | DataProtoFuture:
    return concat_outputs(outputs)


def collect_megatron(wg, outputs: list) -> list:
    """Outputs of the tp 0, cp 0, last-pipeline-stage ranks, in data-parallel order."""
    layout = wg.parallel_layout()
    chosen = sorted((ranks.dp, rank) for rank, ranks in enumerate(layout) if ranks.is_collect_rank)
    return [outputs[rank] for _, rank in chosen]


def collect_megatron_proto(wg, outputs: list) -> DataProto | DataProtoFuture:
    return concat_outputs(collect_megatron(wg, outputs))


def collect_megatron_pp_as_dp_proto(wg, outputs: list) -> DataProto | DataProtoFuture:
    """Outputs of the tp 0, cp 0 ranks in chunk order (dp * pp_size + pp), so rows line up with the input."""
    layout = wg.parallel_layout()
    chosen = sorted((_pp_as_dp_index(r), rank) for rank, r in enumerate(layout) if r.tp == 0 and r.cp == 0)
    return concat_outputs([outputs[rank] for _, rank in chosen])


def concat_outputs(outputs: list) -> DataProto | DataProtoFuture:
    """DataProto.concat of values, or a DataProtoFuture of the concat when outputs are object refs."""
    ray = sys.modules.get("ray")  # not imported: no object refs exist (the in-process backend)
    if ray is not None and outputs and all(isinstance(out, ray.ObjectRef) for out in outputs):
        return DataProtoFuture.concat(outputs)
    for i, out in enumerate(outputs):
        if not isinstance(out, DataProto):
            raise TypeError(
                f"a *_PROTO method must return a DataProto; output {i} of {len(outputs)} "
                f"is a {type(out).__name__}"
            )
    return DataProto.concat(outputs)


def remove_padding(result, padding: int):
    """Drop the auto-padding rows from a collected DataProto (or from a future's value)."""
    if padding == 0 or isinstance(result, list):
        return result
    if isinstance(result, DataProtoFuture):
        return DataProtoFuture(
            collect_fn=partial(_collect_then_unpad, collect_fn=result.collect_fn, padding=padding),
            futures=result.futures,
            dispatch_fn=result.dispatch_fn,
        )
    return unpad_dataproto(result, padding)


BUILTIN: dict[Dispatch, tuple[Callable, Callable]] = {
    Dispatch.ONE_TO_ALL: (dispatch_one_to_all, collect_list),
    Dispatch.ALL_TO_ALL: (partial(dispatch_per_rank_lists, Dispatch.ALL_TO_ALL), collect_list),
    Dispatch.RANK_ZERO: (dispatch_rank_zero, collect_list),
    Dispatch.DP_COMPUTE: (partial(dispatch_per_rank_lists, Dispatch.DP_COMPUTE), collect_list),
    Dispatch.DP_COMPUTE_PROTO: (partial(dispatch_dp_proto, Dispatch.DP_COMPUTE_PROTO), collect_concat),
    Dispatch.DP_COMPUTE_PROTO_WITH_FUNC: (dispatch_dp_proto_with_func, collect_concat),
    Dispatch.DP_COMPUTE_METRIC: (partial(dispatch_dp_proto, Dispatch.DP_COMPUTE_METRIC), collect_list),
    Dispatch.MEGATRON_COMPUTE: (dispatch_megatron, collect_megatron),
    Dispatch.MEGATRON_COMPUTE_PROTO: (dispatch_megatron_proto, collect_megatron_proto),
    Dispatch.MEGATRON_PP_AS_DP_PROTO: (dispatch_megatron_pp_as_dp_proto, collect_megatron_pp_as_dp_proto),
}


# ---------------------------------------------------------------------- helpers
def _check_lists(mode: Dispatch, size: int, size_name: str, args: tuple, kwargs: dict) -> None:
    named = [(f"argument {i}", arg) for i, arg in enumerate(args)] + [(repr(k), v) for k, v in kwargs.items()]
    for name, value in named:
        if not isinstance(value, list | tuple) or len(value) != size:
            got = (
                f"a {type(value).__name__} of length {len(value)}"
                if isinstance(value, list | tuple)
                else (f"a {type(value).__name__}")
            )
            raise ValueError(
                f"{mode.name} expects every argument to be a list with one item per rank "
                f"({size_name}, {size}); {name} is {got}"
            )


def _split_protos(mode: Dispatch, chunks: int, args: tuple, kwargs: dict) -> Dispatched:
    named = [(f"argument {i}", arg) for i, arg in enumerate(args)] + [(repr(k), v) for k, v in kwargs.items()]
    for name, value in named:
        if not isinstance(value, DataProto | DataProtoFuture):
            raise TypeError(
                f"{mode.name} splits every argument along the batch; {name} is a "
                f"{type(value).__name__}, expected DataProto or DataProtoFuture"
            )
    padding, padded = _pad_if_enabled(mode, chunks, dict(named))
    split = {name: padded[name].chunk(chunks) for name, _ in named}
    positional = tuple(split[f"argument {i}"] for i in range(len(args)))
    return Dispatched(positional, {k: split[repr(k)] for k in kwargs}, padding)


def _pad_if_enabled(mode: Dispatch, chunks: int, named: dict) -> tuple[int, dict]:
    protos = {name: value for name, value in named.items() if isinstance(value, DataProto)}
    lengths = {name: len(value) for name, value in protos.items()}
    if len(set(lengths.values())) > 1:
        raise ValueError(f"{mode.name} needs DataProto arguments of one batch size, got {lengths}")
    if not lengths or next(iter(lengths.values())) % chunks == 0:
        return 0, named
    rows = next(iter(lengths.values()))
    if not any(value.is_padding_enabled() for value in protos.values()):
        raise ValueError(
            f"{mode.name}: batch size {rows} is not divisible by {chunks} chunks; enable auto-padding "
            "(meta_info[DataProtoConfig.auto_padding_key] = True) or send a divisible batch"
        )
    if len(protos) != len(named):
        raise ValueError(f"{mode.name}: cannot auto-pad a batch of {rows} rows mixed with DataProtoFutures")
    padded = {name: pad_dataproto_to_divisor(value, chunks) for name, value in protos.items()}
    padding = next(iter(padded.values()))[1]
    return padding, {name: proto for name, (proto, _) in padded.items()}


def _select_per_rank(args: tuple, kwargs: dict, index_of_rank: list[int], padding: int) -> Dispatched:
    return Dispatched(
        tuple([arg[i] for i in index_of_rank] for arg in args),
        {k: [v[i] for i in index_of_rank] for k, v in kwargs.items()},
        padding,
    )


def _pp_as_dp_index(ranks) -> int:
    return ranks.dp * ranks.pp_size + ranks.pp


def _collect_then_unpad(parts: list[DataProto], collect_fn: Callable, padding: int) -> DataProto:
    return unpad_dataproto(collect_fn(parts), padding)
