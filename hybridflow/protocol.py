"""DataProto: the batch container passed between the single controller and every worker role.

A `DataProto` holds one batch of samples in three parts (verl-compatible names and semantics):
  - `batch`: a `tensordict.TensorDict` with exactly one batch dimension (B), or None;
  - `non_tensor_batch`: dict of numpy arrays whose first dimension is B (object dtype allowed,
    e.g. prompt uids, raw chat messages, reward-model dicts);
  - `meta_info`: a plain dict shared by the whole batch (temperature, micro batch size, metrics).

`DataProtoFuture` wraps Ray object refs of DataProtos so a worker group can hand results of one
call to the next without the driver fetching them. `all_gather_data_proto` concatenates a
DataProto across a torch.distributed group.

Conventions (docs/dataproto.md has the full list, including where verl's DataProto differs):
  - verl's calling conventions work: `None` parts are empty, `from_dict` turns per-sample lists
    into 1-D object arrays and takes `auto_padding=`, and conflicting values in `concat`/`union`
    raise `DataProtoConflictError`, which is both a `ValueError` and an `AssertionError`.
  - Missing keys raise `KeyError`; malformed input raises `TypeError`/`ValueError` naming the key.
  - Pickling moves tensor bytes as numpy buffers (out-of-band with pickle protocol 5 / Ray), so
    a chunk carries only its own rows, and unpickled tensors always live on CPU.
  - Tensors received over Ray stay in Ray's read-only object-store memory until `batch` is first
    read, which copies them (copy on first access): code that only forwards, slices, concatenates
    or moves the data to a device never pays for a CPU copy, and code that reads `batch` always
    gets memory it may write.
  - `meta_info["metrics"]` is combined by `concat` (see `DataProto.concat`), never dropped.

Benchmark: `python -m benchmarks protocol`.
"""

from __future__ import annotations

import copy
import os
import pickle
import threading
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
from tensordict import TensorDict
from torch.utils.data import DataLoader

__all__ = [
    "DataProto",
    "DataProtoConfig",
    "DataProtoConflictError",
    "DataProtoFuture",
    "DataProtoItem",
    "all_gather_data_proto",
    "pad_dataproto_to_divisor",
    "unpad_dataproto",
]

METRICS_KEY = "metrics"
# non_tensor_batch key of image prompts' pixels: one (n_images, 3, H, W) float32 array per row, the
# rows' images in the order of their image tokens (hybridflow/data/image_prompts.py).
PIXEL_VALUES_KEY = "pixel_values"
# Integer dtypes used to carry tensor bytes whose dtype numpy lacks (bfloat16, float8, ...).
_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_COPY_LOCK = threading.Lock()  # guards the copy of borrowed tensors (see DataProto.batch)


class DataProtoConflictError(ValueError, AssertionError):
    """Two DataProtos disagree on a key that `concat` or `union` must merge.

    A `ValueError` (hybridflow's convention for bad values) that is also an `AssertionError`, so
    code written for verl, whose DataProto raises `AssertionError` here, catches it unchanged.
    """


class DataProtoConfig:
    """Names of the switches stored in `meta_info`.

    `meta_info[DataProtoConfig.auto_padding_key] = True` lets `chunk` accept a length that does
    not divide evenly; the single controller's DP_COMPUTE_PROTO dispatch then pads with
    `pad_dataproto_to_divisor` before chunking and strips the padding after collecting.
    """

    auto_padding_key: ClassVar[str] = "_hybridflow_auto_padding"


@dataclass
class DataProtoItem:
    """One sample: `batch` is a TensorDict with empty batch size, non-tensors are scalars/objects."""

    batch: TensorDict | None = None
    non_tensor_batch: dict[str, Any] = field(default_factory=dict)
    meta_info: dict[str, Any] = field(default_factory=dict)


class DataProto:
    """A batch of B samples: tensors in `batch`, numpy arrays in `non_tensor_batch`, `meta_info`.

    `None` for any part means empty (verl's convention). Tensors unpickled from read-only memory
    (Ray's object store) are "borrowed": they stay in that memory, and reading `batch` first
    replaces them with private copies, so writes never reach memory other readers share.
    Operations that only read or slice (len, chunk, split, select, concat, `to`, pickling
    again) work on borrowed tensors without copying them.
    """

    def __init__(
        self,
        batch: TensorDict | None = None,
        non_tensor_batch: dict[str, np.ndarray] | None = None,
        meta_info: dict[str, Any] | None = None,
    ):
        self._batch = batch
        self._borrowed: frozenset[str] = frozenset()  # batch keys still in read-only memory
        self.non_tensor_batch = {} if non_tensor_batch is None else non_tensor_batch
        self.meta_info = {} if meta_info is None else meta_info
        self.check_consistency()

    @property
    def batch(self) -> TensorDict | None:
        """The tensors; borrowed (read-only) ones are copied here, on first access."""
        if self._borrowed:
            with _COPY_LOCK:  # two threads reading at once must not each make (and write) a copy
                for key in self._borrowed:
                    self._batch[key] = self._batch[key].clone()
                self._borrowed = frozenset()
        return self._batch

    @batch.setter
    def batch(self, value: TensorDict | None) -> None:
        self._batch, self._borrowed = value, frozenset()

    @classmethod
    def _sharing(cls, batch: TensorDict | None, borrowed: Iterable[str], **parts) -> DataProto:
        """A DataProto whose `batch` shares memory with a borrowed one: keeps the borrowed keys."""
        data = cls(batch=batch, **parts)
        data._borrowed = frozenset(borrowed) & frozenset(() if batch is None else batch.keys())
        return data

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_dict(
        cls,
        tensors: Mapping[str, torch.Tensor] | None = None,
        non_tensors: Mapping[str, np.ndarray | Sequence] | None = None,
        meta_info: Mapping[str, Any] | None = None,
        num_batch_dims: int = 1,
        auto_padding: bool = False,
    ) -> DataProto:
        """Build from tensors (each with leading batch dim B) and per-sample non-tensors.

        Empty or None `tensors` gives `batch=None` (a non-tensor-only DataProto). A non-tensor
        may be a numpy array (first dim B) or a list/tuple of B values, stored as a 1-D object
        array (one entry per sample, even when the entries are equal-length lists).
        `auto_padding=True` sets `meta_info[DataProtoConfig.auto_padding_key]` (see `chunk`).
        `num_batch_dims` exists for verl's signature; only 1 is supported.
        """
        if num_batch_dims != 1:
            raise ValueError(
                f"num_batch_dims must be 1 (DataProto has exactly one batch dimension), "
                f"got {num_batch_dims!r}"
            )
        tensors = _check_mapping("tensors", tensors)
        non_tensors = _check_mapping("non_tensors", non_tensors)
        meta_info = dict(_check_mapping("meta_info", meta_info))
        if auto_padding:
            meta_info[DataProtoConfig.auto_padding_key] = True
        batch = None
        if tensors:
            batch_size = _common_batch_size(tensors)
            batch = TensorDict(dict(tensors), batch_size=[batch_size])
        arrays = {k: _object_array(v) if isinstance(v, list | tuple) else v for k, v in non_tensors.items()}
        return cls(batch=batch, non_tensor_batch=arrays, meta_info=meta_info)

    @classmethod
    def from_single_dict(
        cls, data: Mapping[str, Any], meta_info: Mapping[str, Any] | None = None, auto_padding: bool = False
    ) -> DataProto:
        """Split one dict into tensors and non-tensors; lists/tuples become 1-D object arrays."""
        data = _check_mapping("data", data)
        tensors, non_tensors = {}, {}
        for key, value in data.items():
            if isinstance(value, torch.Tensor):
                tensors[key] = value
            elif isinstance(value, np.ndarray):
                non_tensors[key] = value
            elif isinstance(value, list | tuple):
                non_tensors[key] = _object_array(value)
            else:
                raise TypeError(
                    f"data[{key!r}] must be a torch.Tensor, numpy array, list or tuple with one entry "
                    f"per sample, got {type(value).__name__}"
                )
        return cls.from_dict(
            tensors=tensors, non_tensors=non_tensors, meta_info=meta_info, auto_padding=auto_padding
        )

    # ------------------------------------------------------------------ validation and info
    def check_consistency(self) -> None:
        """Raise TypeError/ValueError naming the offending key if the parts disagree on B."""
        batch = self._batch
        if batch is not None:
            if not isinstance(batch, TensorDict):
                raise TypeError(f"DataProto.batch must be a TensorDict or None, got {type(batch).__name__}")
            if batch.batch_dims != 1:
                raise ValueError(
                    f"DataProto.batch must have exactly one batch dimension, got batch_size "
                    f"{tuple(batch.batch_size)}"
                )
            for key, value in batch.items():
                if not isinstance(value, torch.Tensor) or isinstance(value, TensorDict):
                    raise TypeError(f"batch[{key!r}] must be a torch.Tensor, got {type(value).__name__}")
        if not isinstance(self.non_tensor_batch, dict):
            raise TypeError(f"non_tensor_batch must be a dict, got {type(self.non_tensor_batch).__name__}")
        if not isinstance(self.meta_info, dict):
            raise TypeError(f"meta_info must be a dict, got {type(self.meta_info).__name__}")
        expected = None if batch is None else batch.batch_size[0]
        reference = "batch"
        for key, value in self.non_tensor_batch.items():
            _check_non_tensor(key, value)
            if expected is None:
                expected, reference = value.shape[0], f"non_tensor_batch[{key!r}]"
            elif value.shape[0] != expected:
                raise ValueError(
                    f"non_tensor_batch[{key!r}] has {value.shape[0]} rows but {reference} has {expected}"
                )

    def __len__(self) -> int:
        if self._batch is not None:
            return int(self._batch.batch_size[0])
        for value in self.non_tensor_batch.values():
            return int(value.shape[0])
        return 0

    def is_padding_enabled(self) -> bool:
        """True when `meta_info[DataProtoConfig.auto_padding_key]` is set (see `chunk`)."""
        return bool(self.meta_info.get(DataProtoConfig.auto_padding_key, False))

    def __repr__(self) -> str:
        tensors = ", ".join(f"{k!r}: {tuple(v.shape)} {v.dtype} {v.device}" for k, v in self._tensor_items())
        non_tensors = ", ".join(f"{k!r}: {v.shape} {v.dtype}" for k, v in self.non_tensor_batch.items())
        batch_part = "None" if self._batch is None else "{" + tensors + "}"
        return (
            f"DataProto(len={len(self)},\n  batch={batch_part},\n  non_tensor_batch={{{non_tensors}}},\n"
            f"  meta_info_keys={sorted(map(str, self.meta_info))})"
        )

    def get_data_info(self) -> str:
        """Multi-line description: every key with shape, dtype, device and size in bytes."""
        tensor_bytes = sum(v.numel() * v.element_size() for _, v in self._tensor_items())
        lines = [f"DataProto: {len(self)} rows, {tensor_bytes / 2**20:.3f} MiB of tensors"]
        lines.append("batch:" if self._batch is not None else "batch: None")
        for key, value in self._tensor_items():
            nbytes = value.numel() * value.element_size()
            borrowed = " (read-only memory, copied on first access)" if key in self._borrowed else ""
            lines.append(
                f"  {key}: shape={tuple(value.shape)} dtype={value.dtype} device={value.device} "
                f"bytes={nbytes}{borrowed}"
            )
        lines.append("non_tensor_batch:")
        for key, value in self.non_tensor_batch.items():
            lines.append(f"  {key}: shape={value.shape} dtype={value.dtype}")
        lines.append("meta_info:")
        for key, value in self.meta_info.items():
            lines.append(f"  {key}: {_short_repr(value)}")
        return "\n".join(lines)

    def print_size(self, prefix: str = "") -> None:
        """Print the tensor and non-tensor sizes in GiB (verl's helper)."""
        tensor_gib = sum(v.numel() * v.element_size() for _, v in self._tensor_items()) / 2**30
        array_gib = sum(v.nbytes for v in self.non_tensor_batch.values()) / 2**30
        message = f"Size of tensordict: {tensor_gib} GB, size of non_tensor_batch: {array_gib} GB"
        print(f"{prefix}, {message}" if prefix else message)

    def _tensor_items(self) -> list[tuple[str, torch.Tensor]]:
        return [] if self._batch is None else list(self._batch.items())

    # ------------------------------------------------------------------ indexing
    def __getitem__(self, index) -> DataProto | DataProtoItem:
        """int -> DataProtoItem; slice, int list/array/tensor or boolean mask -> DataProto."""
        if isinstance(index, int | np.integer) or (isinstance(index, torch.Tensor) and index.dim() == 0):
            return self._item(int(index))
        if isinstance(index, slice):
            return self._slice(index)
        return self._take(_row_indices(index, len(self)))

    def _item(self, index: int) -> DataProtoItem:
        n = len(self)
        if not -n <= index < n:
            raise IndexError(f"index {index} is out of range for a DataProto of {n} rows")
        index %= n
        batch = None
        if self._batch is not None:  # borrowed rows are copied: an item's tensors are writable views
            rows = {k: v[index].clone() if k in self._borrowed else v[index] for k, v in self._batch.items()}
            batch = TensorDict(rows, batch_size=[])
        non_tensors = {k: v[index] for k, v in self.non_tensor_batch.items()}
        return DataProtoItem(batch=batch, non_tensor_batch=non_tensors, meta_info=self.meta_info)

    def _slice(self, index: slice) -> DataProto:
        start, stop, step = index.indices(len(self))
        if step < 0:  # torch has no negative-step views
            return self._take(np.arange(start, stop, step, dtype=np.int64))
        rows = len(range(start, stop, step))
        batch = None
        if self._batch is not None:
            batch = TensorDict({k: v[start:stop:step] for k, v in self._batch.items()}, batch_size=[rows])
        non_tensors = {k: v[start:stop:step] for k, v in self.non_tensor_batch.items()}
        return DataProto._sharing(
            batch, self._borrowed, non_tensor_batch=non_tensors, meta_info=dict(self.meta_info)
        )

    def _take(self, indices: np.ndarray) -> DataProto:
        """Rows `indices` (int64, already in range) as a new DataProto holding copies."""
        batch = None
        if self._batch is not None:
            index = torch.from_numpy(indices)
            batch = TensorDict(
                {k: v.index_select(0, index.to(v.device)) for k, v in self._batch.items()},
                batch_size=[len(indices)],
            )
        non_tensors = {k: v[indices] for k, v in self.non_tensor_batch.items()}
        return DataProto(batch=batch, non_tensor_batch=non_tensors, meta_info=dict(self.meta_info))

    def select_idxs(self, idxs: Sequence[int] | np.ndarray | torch.Tensor) -> DataProto:
        """Rows `idxs` (ints or a boolean mask) as a new DataProto holding copies (verl's name)."""
        return self._take(_row_indices(idxs, len(self)))

    def slice(self, start: int | None = None, end: int | None = None, step: int | None = None) -> DataProto:
        """`self[start:end:step]` (verl's name): views for a positive step."""
        return self._slice(slice(start, end, step))

    def make_iterator(
        self,
        mini_batch_size: int,
        epochs: int,
        seed: int | None = None,
        dataloader_kwargs: Mapping[str, Any] | None = None,
    ) -> Iterator[DataProto]:
        """Mini-batches of `mini_batch_size` rows, `epochs` passes over the data (verl's signature).

        `dataloader_kwargs` go to torch's DataLoader over row numbers (e.g. `shuffle=True`, whose
        order `seed` fixes). Each mini-batch holds copies of its rows and this batch's meta_info.
        """
        _check_positive_int("mini_batch_size", mini_batch_size)
        _check_positive_int("epochs", epochs)
        if len(self) % mini_batch_size:
            raise ValueError(
                f"mini_batch_size {mini_batch_size} does not divide the batch of {len(self)} rows"
            )
        generator = None if seed is None else torch.Generator().manual_seed(seed)
        loader = DataLoader(
            range(len(self)),
            batch_size=mini_batch_size,
            generator=generator,
            collate_fn=self.select_idxs,
            **(dataloader_kwargs or {}),
        )
        return (mini_batch for _ in range(epochs) for mini_batch in loader)

    # ------------------------------------------------------------------ key operations
    def select(
        self,
        batch_keys: Sequence[str] | None = None,
        non_tensor_batch_keys: Sequence[str] | None = None,
        meta_info_keys: Sequence[str] | None = None,
        deepcopy: bool = False,
    ) -> DataProto:
        """A DataProto with only the given keys (None = all keys of that part).

        Without `deepcopy` the result shares tensors and arrays with `self`.
        """
        batch = None
        if self._batch is not None:
            keys = list(self._batch.keys())
            if batch_keys is not None:
                keys = _existing(batch_keys, self._batch, "batch")
            batch = TensorDict({k: self._batch[k] for k in keys}, batch_size=self._batch.batch_size)
        elif batch_keys:
            raise KeyError(f"batch keys {list(batch_keys)} requested but DataProto.batch is None")
        nt_keys = self.non_tensor_batch.keys() if non_tensor_batch_keys is None else non_tensor_batch_keys
        nt_keys = _existing(nt_keys, self.non_tensor_batch, "non_tensor_batch")
        meta_keys = _existing(
            self.meta_info.keys() if meta_info_keys is None else meta_info_keys, self.meta_info, "meta_info"
        )
        selected = DataProto._sharing(
            batch,
            self._borrowed,
            non_tensor_batch={k: self.non_tensor_batch[k] for k in nt_keys},
            meta_info={k: self.meta_info[k] for k in meta_keys},
        )
        return copy.deepcopy(selected) if deepcopy else selected

    def pop(
        self,
        batch_keys: Sequence[str] | None = None,
        non_tensor_batch_keys: Sequence[str] | None = None,
        meta_info_keys: Sequence[str] | None = None,
    ) -> DataProto:
        """Remove the given keys (None = none of that part) from `self` and return them."""
        batch_keys = _existing(batch_keys or [], self._batch if self._batch is not None else {}, "batch")
        nt_keys = _existing(non_tensor_batch_keys or [], self.non_tensor_batch, "non_tensor_batch")
        meta_keys = _existing(meta_info_keys or [], self.meta_info, "meta_info")
        batch, borrowed = None, self._borrowed
        if batch_keys:
            batch = TensorDict({k: self._batch.pop(k) for k in batch_keys}, batch_size=self._batch.batch_size)
            self._borrowed = self._borrowed - set(batch_keys)
        return DataProto._sharing(
            batch,
            borrowed,
            non_tensor_batch={k: self.non_tensor_batch.pop(k) for k in nt_keys},
            meta_info={k: self.meta_info.pop(k) for k in meta_keys},
        )

    def rename(self, old_keys: str | Sequence[str], new_keys: str | Sequence[str]) -> DataProto:
        """Rename batch or non-tensor keys in place; returns `self`."""
        old_keys = [old_keys] if isinstance(old_keys, str) else list(old_keys)
        new_keys = [new_keys] if isinstance(new_keys, str) else list(new_keys)
        if len(old_keys) != len(new_keys):
            raise ValueError(f"rename got {len(old_keys)} old keys {old_keys} but {len(new_keys)} new keys")
        for old, new in zip(old_keys, new_keys, strict=True):
            if self._batch is not None and old in self._batch:
                container, name = self._batch, "batch"
            elif old in self.non_tensor_batch:
                container, name = self.non_tensor_batch, "non_tensor_batch"
            else:
                raise KeyError(f"rename: key {old!r} is in neither batch nor non_tensor_batch")
            if new != old and new in container:
                raise ValueError(f"rename: {name} already has key {new!r} (renaming {old!r})")
            container[new] = container.pop(old)
            if old in self._borrowed and container is self._batch:
                self._borrowed = self._borrowed - {old} | {new}
        return self

    def union(self, other: DataProto) -> DataProto:
        """Merge `other` into `self` in place and return `self`.

        A key present in both must hold equal values (tensors, arrays, meta values), otherwise
        `DataProtoConflictError` (a ValueError and an AssertionError) naming it, raised before
        anything changes; `meta_info["metrics"]` is combined as in `concat`. Both must have the
        same length unless one holds no data at all (DataProtoConflictError otherwise).
        """
        if not isinstance(other, DataProto):
            raise TypeError(f"union expects a DataProto, got {type(other).__name__}")
        if not (self._holds_nothing() or other._holds_nothing()) and len(self) != len(other):
            raise DataProtoConflictError(f"union: lengths differ ({len(self)} vs {len(other)})")
        for key, value in other._tensor_items():
            if self._batch is not None and key in self._batch and not _tensors_equal(self._batch[key], value):
                raise DataProtoConflictError(
                    f"union: batch key {key!r} holds different tensors in the two DataProtos"
                )
        for key, value in other.non_tensor_batch.items():
            if key in self.non_tensor_batch and not _values_equal(self.non_tensor_batch[key], value):
                raise DataProtoConflictError(f"union: non_tensor_batch key {key!r} holds different arrays")
        meta_info = _merge_meta_infos([self.meta_info, other.meta_info])
        if other._batch is not None:
            if self._batch is None:
                self._batch = TensorDict({}, batch_size=other._batch.batch_size)
            self._batch.update(dict(other._batch.items()))
            # a key from `other` now holds other's tensor, borrowed or not
            self._borrowed = self._borrowed - set(other._batch.keys()) | other._borrowed
        self.non_tensor_batch.update(other.non_tensor_batch)
        self.meta_info.update(meta_info)
        self.check_consistency()
        return self

    def _holds_nothing(self) -> bool:
        return self._batch is None and not self.non_tensor_batch

    # ------------------------------------------------------------------ batch-dimension operations
    @staticmethod
    def concat(data: Sequence[DataProto]) -> DataProto:
        """Concatenate along the batch dimension in list order.

        All parts need the same batch and non-tensor keys. meta_info is merged: a key in several
        parts must hold equal values (`DataProtoConflictError` naming it otherwise, which verl
        code catches as an AssertionError), except `metrics`, which
        is combined into one dict of lists. Each part's `metrics` may be a dict (list values are
        extended, scalar values appended) or a list of such dicts; key `k` of the result lists
        every part's values for `k` in part order.
        """
        data = list(data)
        if not data:
            raise ValueError("DataProto.concat needs at least one DataProto")
        for i, part in enumerate(data):
            if not isinstance(part, DataProto):
                raise TypeError(f"DataProto.concat: item {i} is a {type(part).__name__}, expected DataProto")
        return DataProto(
            batch=_concat_batches([part._batch for part in data]),
            non_tensor_batch=_concat_non_tensors([part.non_tensor_batch for part in data]),
            meta_info=_merge_meta_infos([part.meta_info for part in data]),
        )

    def chunk(self, chunks: int) -> list[DataProto]:
        """Split into `chunks` contiguous pieces (views of `self`), always exactly `chunks` of them.

        The length must divide evenly unless padding is enabled (`is_padding_enabled()`); then
        the first `len % chunks` pieces get one extra row (sizes differ by at most one, some may
        be empty). Dispatch normally pads with `pad_dataproto_to_divisor` first, so pieces are equal.
        """
        _check_positive_int("chunks", chunks)
        rows = len(self)
        if rows % chunks and not self.is_padding_enabled():
            raise ValueError(
                f"cannot chunk {rows} rows into {chunks} equal chunks; pad first with "
                f"pad_dataproto_to_divisor(data, {chunks}) or set "
                f"meta_info[{DataProtoConfig.auto_padding_key!r}] = True"
            )
        base, extra = divmod(rows, chunks)
        bounds = np.cumsum([0] + [base + (i < extra) for i in range(chunks)])
        return [self[int(bounds[i]) : int(bounds[i + 1])] for i in range(chunks)]

    def split(self, split_size: int) -> list[DataProto]:
        """Pieces of `split_size` rows (views); the last one may be shorter."""
        _check_positive_int("split_size", split_size)
        return [self[start : start + split_size] for start in range(0, len(self), split_size)]

    def repeat(self, repeat_times: int = 2, interleave: bool = True) -> DataProto:
        """Each row `repeat_times` times: [a, a, b, b] with interleave, else [a, b, a, b]."""
        _check_positive_int("repeat_times", repeat_times)
        rows = np.arange(len(self), dtype=np.int64)
        indices = np.repeat(rows, repeat_times) if interleave else np.tile(rows, repeat_times)
        return self._take(indices)

    def sample_level_repeat(self, repeat_times: Sequence[int] | np.ndarray | torch.Tensor) -> DataProto:
        """Row i repeated `repeat_times[i]` times (0 drops it), rows kept in order."""
        counts = (
            repeat_times.cpu().numpy() if isinstance(repeat_times, torch.Tensor) else np.asarray(repeat_times)
        )
        if counts.shape != (len(self),):
            raise ValueError(
                f"sample_level_repeat needs one count per row ({len(self)}), got shape {counts.shape}"
            )
        if counts.size and (not np.issubdtype(counts.dtype, np.integer) or counts.min() < 0):
            raise ValueError(f"sample_level_repeat counts must be non-negative integers, got {counts!r}")
        return self._take(np.repeat(np.arange(len(self), dtype=np.int64), counts.astype(np.int64)))

    def reorder(self, indices: Sequence[int] | np.ndarray | torch.Tensor) -> None:
        """Permute rows in place: row i becomes old row `indices[i]`; indices must be a permutation."""
        order = _row_indices(indices, len(self))
        if len(order) != len(self) or np.bincount(order, minlength=len(self)).max(initial=1) != 1:
            raise ValueError(
                f"reorder needs a permutation of range({len(self)}), got {np.asarray(indices)!r}"
            )
        reordered = self._take(order)
        self.batch, self.non_tensor_batch = reordered._batch, reordered.non_tensor_batch

    def to(self, device: str | torch.device) -> DataProto:
        """Move tensors to `device` in place; returns `self`.

        Moving borrowed tensors off the CPU reads them straight from read-only memory: no CPU copy.
        """
        if self._batch is not None:
            before = dict(self._batch.items())
            self._batch = self._batch.to(device)
            # tensors already on `device` are kept as they are, and stay borrowed
            self._borrowed = frozenset(
                k for k in self._borrowed if self._batch[k].data_ptr() == before[k].data_ptr()
            )
        return self

    # ------------------------------------------------------------------ serialisation
    def __getstate__(self) -> dict[str, Any]:
        # Tensors travel as numpy arrays: pickle protocol 5 (and Ray) move their buffers without
        # copying element by element, and a slice carries only its own rows, not its base storage.
        tensors = None
        if self._batch is not None:
            tensors = {k: _tensor_to_numpy(k, v) for k, v in self._batch.items()}
        return {
            "tensors": tensors,
            "batch_size": None if self._batch is None else tuple(self._batch.batch_size),
            "non_tensor_batch": self.non_tensor_batch,
            "meta_info": self.meta_info,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._batch, self._borrowed = None, frozenset()
        if state["tensors"] is not None:
            tensors = {k: _numpy_to_tensor(array, dtype) for k, (array, dtype) in state["tensors"].items()}
            self._batch = TensorDict(tensors, batch_size=list(state["batch_size"]))
            # out-of-band buffers from Ray's object store are read-only and shared with other readers
            arrays = state["tensors"].items()
            self._borrowed = frozenset(k for k, (array, _) in arrays if not array.flags.writeable)
        self.non_tensor_batch = state["non_tensor_batch"]
        self.meta_info = state["meta_info"]

    def __deepcopy__(self, memo: dict) -> DataProto:
        # Keeps tensors on their device (pickling would bring them to CPU).
        return DataProto(
            batch=None if self._batch is None else self._batch.clone(),
            non_tensor_batch=copy.deepcopy(self.non_tensor_batch, memo),
            meta_info=copy.deepcopy(self.meta_info, memo),
        )

    def save_to_disk(self, path: str | os.PathLike) -> None:
        """Pickle to `path` atomically (temporary file in the same directory, then rename)."""
        path = Path(path)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            with open(tmp, "wb") as f:
                pickle.dump(self, f, protocol=5)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)

    @staticmethod
    def load_from_disk(path: str | os.PathLike) -> DataProto:
        """Load a file written by `save_to_disk` (a pickle: only load files you trust)."""
        with open(path, "rb") as f:
            data = pickle.load(f)
        if not isinstance(data, DataProto):
            raise TypeError(f"{path} holds a {type(data).__name__}, expected a DataProto")
        return data


# ---------------------------------------------------------------------- padding
def pad_dataproto_to_divisor(data: DataProto, size_divisor: int) -> tuple[DataProto, int]:
    """Append rows repeated from the start (cycling) so len is a multiple of `size_divisor`.

    Returns (padded, pad_size); `data` itself is unchanged and returned as-is when pad_size is 0.
    """
    if not isinstance(data, DataProto):
        raise TypeError(f"pad_dataproto_to_divisor expects a DataProto, got {type(data).__name__}")
    _check_positive_int("size_divisor", size_divisor)
    rows = len(data)
    pad_size = -rows % size_divisor
    if pad_size == 0:
        return data, 0
    indices = np.concatenate([np.arange(rows), np.arange(pad_size) % rows]).astype(np.int64)
    return data._take(indices), pad_size


def answer_meta(meta_info: Mapping[str, Any]) -> dict[str, Any]:
    """A call's meta_info as its answer carries it on: without the call's auto-padding request, so
    that a later call on the answer (e.g. a training step on the generated batch) pads only where
    its own caller asks."""
    return {key: value for key, value in meta_info.items() if key != DataProtoConfig.auto_padding_key}


def unpad_dataproto(data: DataProto, pad_size: int) -> DataProto:
    """Drop the last `pad_size` rows added by `pad_dataproto_to_divisor`.

    A DataProto holding no rows at all (only meta_info, e.g. the metrics a training step
    returns) has nothing to unpad and is returned unchanged.
    """
    if data._holds_nothing():
        return data
    if not 0 <= pad_size <= len(data):
        raise ValueError(f"pad_size must be in [0, {len(data)}] for this DataProto, got {pad_size}")
    return data[: len(data) - pad_size] if pad_size else data


# ---------------------------------------------------------------------- futures
def _chunk_then_pick(data: DataProto, chunks: int, index: int, inner: Callable | None) -> DataProto:
    if inner is not None:
        data = inner(data)
    return data.chunk(chunks)[index]


@dataclass
class DataProtoFuture:
    """DataProtos still in Ray's object store: `get()` fetches them, applies `collect_fn`
    (e.g. `DataProto.concat`) and then `dispatch_fn` (e.g. pick chunk i) if set."""

    collect_fn: Callable[[list[DataProto]], DataProto]
    futures: list  # list[ray.ObjectRef]; ray is imported lazily to keep `import hybridflow` light
    dispatch_fn: Callable[[DataProto], DataProto] | None = None

    @staticmethod
    def concat(data: Iterable) -> DataProtoFuture:
        """A future of the concatenation of DataProto object refs, in list order."""
        import ray

        refs = list(data)
        for i, ref in enumerate(refs):
            if not isinstance(ref, ray.ObjectRef):
                raise TypeError(
                    f"DataProtoFuture.concat: item {i} is a {type(ref).__name__}, expected ray.ObjectRef"
                )
        return DataProtoFuture(collect_fn=DataProto.concat, futures=refs)

    def chunk(self, chunks: int) -> list[DataProtoFuture]:
        """`chunks` futures; future i resolves to chunk i of this future's value."""
        _check_positive_int("chunks", chunks)
        return [
            DataProtoFuture(
                collect_fn=self.collect_fn,
                futures=self.futures,
                dispatch_fn=partial(_chunk_then_pick, chunks=chunks, index=i, inner=self.dispatch_fn),
            )
            for i in range(chunks)
        ]

    def get(self) -> DataProto:
        import ray

        parts = ray.get(self.futures)
        for i, part in enumerate(parts):
            if not isinstance(part, DataProto):
                raise TypeError(
                    f"DataProtoFuture: ref {i} resolved to a {type(part).__name__}, expected DataProto"
                )
        output = self.collect_fn(parts)
        return output if self.dispatch_fn is None else self.dispatch_fn(output)


# ---------------------------------------------------------------------- distributed
def all_gather_data_proto(data: DataProto, process_group=None) -> DataProto:
    """Concatenation of every rank's `data` in rank order, returned on every rank (gloo or NCCL).

    Returns a new DataProto on the device of `data`'s tensors; `data` is left unchanged (unlike
    verl, which gathers in place). Ranks may hold different lengths; meta_info merges as in
    `DataProto.concat`. With NCCL, call `torch.cuda.set_device` first.
    """
    import torch.distributed as dist

    device = next((v.device for _, v in data._tensor_items()), None)
    gathered: list[DataProto | None] = [None] * dist.get_world_size(group=process_group)
    dist.all_gather_object(gathered, data, group=process_group)
    merged = DataProto.concat(gathered)
    return merged.to(device) if device is not None else merged


# ---------------------------------------------------------------------- private helpers
def _check_mapping(name: str, value: Mapping | None) -> Mapping:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise TypeError(f"{name} must be a dict, got {type(value).__name__}")
    for key in value:
        if not isinstance(key, str):
            raise TypeError(f"{name} keys must be str, got {key!r}")
    return value


def _check_positive_int(name: str, value: int) -> None:
    if not isinstance(value, int | np.integer) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def _common_batch_size(tensors: Mapping[str, torch.Tensor]) -> int:
    first_key, batch_size = None, None
    for key, value in tensors.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"tensors[{key!r}] must be a torch.Tensor, got {type(value).__name__}")
        if value.dim() == 0:
            raise ValueError(f"tensors[{key!r}] is 0-dim; every tensor needs a leading batch dimension")
        if batch_size is None:
            first_key, batch_size = key, value.shape[0]
        elif value.shape[0] != batch_size:
            raise ValueError(
                f"tensors[{key!r}] has batch size {value.shape[0]} but "
                f"tensors[{first_key!r}] has {batch_size}"
            )
    return batch_size


def _check_non_tensor(key: str, value: Any) -> None:
    if not isinstance(value, np.ndarray):
        raise TypeError(
            f"non_tensor_batch[{key!r}] must be a numpy array with one entry per sample, got "
            f"{type(value).__name__} (DataProto.from_dict and from_single_dict convert lists)"
        )
    if value.ndim == 0:
        raise ValueError(f"non_tensor_batch[{key!r}] is 0-dim; it needs a leading batch dimension")


def _object_array(values: Sequence[Any]) -> np.ndarray:
    """1-D object array; np.array would turn equal-length lists into a 2-D array."""
    array = np.empty(len(values), dtype=object)
    for i, value in enumerate(values):
        array[i] = value
    return array


def _row_indices(index: Any, rows: int) -> np.ndarray:
    """int64 row numbers in [0, rows) from an int sequence/array/tensor or a boolean mask."""
    array = index.detach().cpu().numpy() if isinstance(index, torch.Tensor) else np.asarray(index)
    if array.ndim != 1:
        raise TypeError(f"row index must be 1-D (ints or a boolean mask), got shape {array.shape}")
    if array.dtype == np.bool_:
        if array.shape[0] != rows:
            raise IndexError(f"boolean mask has {array.shape[0]} entries but the DataProto has {rows} rows")
        return np.flatnonzero(array).astype(np.int64)
    if array.size == 0:
        return np.zeros(0, dtype=np.int64)
    if not np.issubdtype(array.dtype, np.integer):
        raise TypeError(f"row index must hold integers or booleans, got dtype {array.dtype}")
    if array.min() < -rows or array.max() >= rows:
        raise IndexError(f"row index {array.min()}..{array.max()} is out of range for {rows} rows")
    return np.where(array < 0, array + rows, array).astype(np.int64)


def _existing(keys: Iterable[str], container: Mapping | TensorDict, name: str) -> list[str]:
    keys = [keys] if isinstance(keys, str) else list(keys)
    available = list(container.keys())
    missing = [k for k in keys if k not in available]
    if missing:
        raise KeyError(f"{name} has no key(s) {missing}; available: {available}")
    return keys


def _tensors_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b.to(a.device))


def _values_equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return _tensors_equal(a, b)
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        if a.shape != b.shape:
            return False
        if a.dtype == object or b.dtype == object:
            return all(_values_equal(x, y) for x, y in zip(a.ravel(), b.ravel(), strict=True))
        return bool(np.array_equal(a, b))
    if isinstance(a, np.ndarray | torch.Tensor) or isinstance(b, np.ndarray | torch.Tensor):
        return False
    result = a == b
    return result if isinstance(result, bool) else bool(np.all(result))


def _concat_batches(batches: list[TensorDict | None]) -> TensorDict | None:
    present = [b is not None for b in batches]
    if not any(present):
        return None
    if not all(present):
        raise ValueError(
            f"DataProto.concat: batch is None in parts {[i for i, p in enumerate(present) if not p]}"
        )
    keys = list(batches[0].keys())
    for i, batch in enumerate(batches[1:], start=1):
        if set(batch.keys()) != set(keys):
            raise ValueError(
                f"DataProto.concat: part {i} has batch keys {sorted(batch.keys())}, part 0 has {sorted(keys)}"
            )
    rows = sum(int(b.batch_size[0]) for b in batches)
    return TensorDict({k: torch.cat([b[k] for b in batches]) for k in keys}, batch_size=[rows])


def _concat_non_tensors(parts: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    keys = set(parts[0])
    for i, part in enumerate(parts[1:], start=1):
        if set(part) != keys:
            raise ValueError(
                f"DataProto.concat: part {i} has non_tensor_batch keys {sorted(part)}, "
                f"part 0 has {sorted(keys)}"
            )
    return {k: np.concatenate([part[k] for part in parts]) for k in parts[0]}


def _merge_meta_infos(parts: list[dict[str, Any]]) -> dict[str, Any]:
    merged: dict[str, Any] = {}
    metrics: dict[str, list] = {}
    saw_metrics = False
    for part in parts:
        for key, value in part.items():
            if key == METRICS_KEY:
                saw_metrics = True
                _extend_metrics(metrics, value)
            elif key in merged and not _values_equal(merged[key], value):
                raise DataProtoConflictError(
                    f"Conflicting values for meta_info key {key!r}: {_short_repr(merged[key])} vs "
                    f"{_short_repr(value)}"
                )
            else:
                merged.setdefault(key, value)
    if saw_metrics:
        merged[METRICS_KEY] = metrics
    return merged


def _extend_metrics(metrics: dict[str, list], value: Any) -> None:
    dicts = value if isinstance(value, list) else [value]
    for entry in dicts:
        if not isinstance(entry, Mapping):
            raise TypeError(
                f"meta_info[{METRICS_KEY!r}] must be a dict of lists/scalars or a list of dicts, "
                f"got an entry of type {type(entry).__name__}"
            )
        for name, values in entry.items():
            target = metrics.setdefault(name, [])
            if isinstance(values, list | tuple):
                target.extend(values)
            else:
                target.append(values)


def _tensor_to_numpy(key: str, tensor: torch.Tensor) -> tuple[np.ndarray, str]:
    if tensor.layout != torch.strided:
        raise TypeError(f"batch[{key!r}] has layout {tensor.layout}; only dense tensors can be pickled")
    tensor = tensor.detach().cpu().resolve_conj().resolve_neg().contiguous()
    dtype = str(tensor.dtype).removeprefix("torch.")
    try:
        return tensor.numpy(), dtype
    except TypeError:  # dtype numpy lacks: ship the same bytes as an integer array
        return tensor.view(_SAME_SIZE_INT[tensor.element_size()]).numpy(), dtype


def _numpy_to_tensor(array: np.ndarray, dtype: str) -> torch.Tensor:
    """A tensor on `array`'s memory; a read-only array gives a borrowed tensor (see DataProto)."""
    with warnings.catch_warnings():  # torch warns that it cannot mark tensors read-only
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        tensor = torch.from_numpy(array)
    target = getattr(torch, dtype)
    return tensor if tensor.dtype == target else tensor.view(target)


def _short_repr(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
