"""DataProto construction, validation, indexing, key operations and batch-dimension operations."""

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from hybridflow.protocol import (
    DataProto,
    DataProtoConfig,
    DataProtoItem,
    pad_dataproto_to_divisor,
    unpad_dataproto,
)


def make_data(rows: int = 6, meta: dict | None = None) -> DataProto:
    """Rows numbered 0..rows-1 in every field so row identity is checkable after any reshuffle."""
    r = torch.arange(rows)
    return DataProto.from_single_dict(
        {
            "input_ids": r[:, None] * 10 + torch.arange(4),  # (B, 4) int64
            "log_probs": r.float()[:, None].repeat(1, 3) / 2,  # (B, 3) float32
            "flag": r % 2 == 0,  # (B,) bool
            "uid": [f"u{i}" for i in range(rows)],
            "reward_model": [{"ground_truth": str(i)} for i in range(rows)],
            "raw_prompt": [[{"role": "user", "content": f"q{i}"}] for i in range(rows)],
        },
        meta_info=meta if meta is not None else {"temperature": 1.0},
    )


def row_ids(data: DataProto) -> list[int]:
    """Original row numbers, checked to agree between tensors and non-tensors."""
    ids = (data.batch["input_ids"][:, 0] // 10).tolist()
    assert [int(u[1:]) for u in data.non_tensor_batch["uid"]] == ids
    assert [int(d["ground_truth"]) for d in data.non_tensor_batch["reward_model"]] == ids
    assert (data.batch["log_probs"][:, 0] * 2).long().tolist() == ids
    return ids


# ---------------------------------------------------------------------- construction
def test_from_single_dict_splits_tensors_and_objects():
    data = make_data(3)
    assert len(data) == 3
    assert isinstance(data.batch, TensorDict) and data.batch.batch_size == torch.Size([3])
    assert sorted(data.batch.keys()) == ["flag", "input_ids", "log_probs"]
    raw = data.non_tensor_batch["raw_prompt"]
    # lists of equal length must stay one object per sample, not become a 2-D array
    assert raw.dtype == object and raw.shape == (3,) and raw[1] == [{"role": "user", "content": "q1"}]
    assert data.meta_info == {"temperature": 1.0}


def test_from_dict_non_tensor_only_and_empty():
    data = DataProto.from_dict(non_tensors={"uid": np.array(["a", "b"], dtype=object)})
    assert data.batch is None and len(data) == 2
    assert len(DataProto()) == 0 and len(DataProto.from_dict(tensors={})) == 0
    zero = DataProto.from_dict(
        tensors={"x": torch.zeros(0, 5)}, non_tensors={"uid": np.array([], dtype=object)}
    )
    assert len(zero) == 0 and zero.batch["x"].shape == (0, 5)


@pytest.mark.parametrize(
    ("kwargs", "error", "words"),
    [
        ({"tensors": {"a": torch.zeros(3, 2), "b": torch.zeros(4)}}, ValueError, ["'b'", "4", "'a'", "3"]),
        ({"tensors": {"scalar": torch.tensor(1.0)}}, ValueError, ["'scalar'", "0-dim"]),
        ({"tensors": {"a": [1, 2]}}, TypeError, ["'a'", "torch.Tensor", "list"]),
        ({"non_tensors": {"uid": {"a": 1}}}, TypeError, ["'uid'", "numpy array", "dict"]),
        ({"non_tensors": {"uid": np.array("a")}}, ValueError, ["'uid'", "0-dim"]),
        (
            {"tensors": {"a": torch.zeros(3)}, "non_tensors": {"uid": np.array(["x"])}},
            ValueError,
            ["'uid'", "1 rows", "3"],
        ),
        (
            {"non_tensors": {"a": np.zeros(2), "b": np.zeros(5)}},
            ValueError,
            ["'b'", "5", "'a'", "2"],
        ),
        ({"tensors": {1: torch.zeros(2)}}, TypeError, ["keys must be str"]),
        ({"meta_info": [1]}, TypeError, ["meta_info", "dict"]),
    ],
)
def test_bad_input_names_key(kwargs, error, words):
    with pytest.raises(error) as info:
        DataProto.from_dict(**kwargs)
    for word in words:
        assert word in str(info.value)


def test_from_single_dict_rejects_scalar_value():
    with pytest.raises(TypeError, match=r"'temperature'.*float"):
        DataProto.from_single_dict({"x": torch.zeros(2), "temperature": 0.7})


def test_check_consistency_on_direct_construction():
    with pytest.raises(ValueError, match="one batch dimension"):
        DataProto(batch=TensorDict({"a": torch.zeros(2, 3)}, batch_size=[2, 3]))
    with pytest.raises(TypeError, match="'nested'"):
        DataProto(batch=TensorDict({"nested": {"x": torch.zeros(2)}}, batch_size=[2]))
    data = make_data(3)
    data.non_tensor_batch["uid"] = data.non_tensor_batch["uid"][:2]
    with pytest.raises(ValueError, match="'uid'"):
        data.check_consistency()


# ---------------------------------------------------------------------- indexing
def test_int_index_returns_item():
    item = make_data(4)[-1]
    assert isinstance(item, DataProtoItem)
    assert item.batch["input_ids"].tolist() == [30, 31, 32, 33]
    assert item.non_tensor_batch["uid"] == "u3" and item.non_tensor_batch["reward_model"] == {
        "ground_truth": "3"
    }
    assert item.meta_info == {"temperature": 1.0}
    with pytest.raises(IndexError, match="out of range"):
        make_data(4)[4]


@pytest.mark.parametrize(
    ("index", "expected"),
    [
        (slice(1, 4), [1, 2, 3]),
        (slice(None, None, 2), [0, 2, 4]),
        (slice(None, None, -2), [5, 3, 1]),
        (slice(4, 2), []),
        ([4, 0, 0], [4, 0, 0]),
        (np.array([-1, 2]), [5, 2]),
        (torch.tensor([3, 1]), [3, 1]),
        ([], []),
        (np.array([True, False, False, True, False, True]), [0, 3, 5]),
        (torch.tensor([False] * 6), []),
    ],
)
def test_index_returns_dataproto(index, expected):
    sub = make_data(6)[index]
    assert isinstance(sub, DataProto) and len(sub) == len(expected)
    assert row_ids(sub) == expected
    assert sub.meta_info == {"temperature": 1.0}


@pytest.mark.parametrize(
    ("index", "error"),
    [([0, 6], IndexError), (np.array([True, False]), IndexError), ([0.5], TypeError), ([[0]], TypeError)],
)
def test_bad_index(index, error):
    with pytest.raises(error):
        make_data(6)[index]


def test_index_on_non_tensor_only():
    data = DataProto.from_single_dict({"uid": ["a", "b", "c"]})
    assert data[[2, 0]].non_tensor_batch["uid"].tolist() == ["c", "a"]
    assert data[1].batch is None and data[1].non_tensor_batch == {"uid": "b"}


# ---------------------------------------------------------------------- select / pop / rename
def test_select_shares_or_copies():
    data = make_data(3, meta={"temperature": 1.0, "mbs": 2})
    sub = data.select(batch_keys=["input_ids"], non_tensor_batch_keys=["uid"], meta_info_keys=["mbs"])
    assert list(sub.batch.keys()) == ["input_ids"] and list(sub.non_tensor_batch) == ["uid"]
    assert sub.meta_info == {"mbs": 2}
    assert sub.batch["input_ids"].data_ptr() == data.batch["input_ids"].data_ptr()
    everything = data.select()
    assert (
        sorted(everything.batch.keys()) == sorted(data.batch.keys()) and len(everything.non_tensor_batch) == 3
    )
    copied = data.select(batch_keys=["input_ids"], non_tensor_batch_keys=["reward_model"], deepcopy=True)
    copied.batch["input_ids"][0, 0] = -1
    copied.non_tensor_batch["reward_model"][0]["ground_truth"] = "changed"
    assert (
        data.batch["input_ids"][0, 0] == 0 and data.non_tensor_batch["reward_model"][0]["ground_truth"] == "0"
    )


@pytest.mark.parametrize(
    "kwargs",
    [{"batch_keys": ["missing"]}, {"non_tensor_batch_keys": ["missing"]}, {"meta_info_keys": ["missing"]}],
)
@pytest.mark.parametrize("method", ["select", "pop"])
def test_missing_key_is_named(method, kwargs):
    with pytest.raises(KeyError, match="missing"):
        getattr(make_data(2), method)(**kwargs)


def test_pop_removes_and_returns():
    data = make_data(3, meta={"temperature": 1.0, "mbs": 2})
    popped = data.pop(batch_keys=["log_probs"], non_tensor_batch_keys=["uid"], meta_info_keys=["mbs"])
    assert list(popped.batch.keys()) == ["log_probs"] and list(popped.non_tensor_batch) == ["uid"]
    assert popped.meta_info == {"mbs": 2} and len(popped) == 3
    assert (
        "log_probs" not in data.batch and "uid" not in data.non_tensor_batch and "mbs" not in data.meta_info
    )
    nothing = data.pop()
    assert nothing.batch is None and not nothing.non_tensor_batch and len(data.batch.keys()) == 2
    assert list(data.pop(batch_keys="flag").batch.keys()) == ["flag"]  # a single key as a str
    data.pop(batch_keys=["input_ids"])
    assert len(data) == 3  # an emptied TensorDict keeps the batch size
    with pytest.raises(KeyError, match="'x'"):
        DataProto.from_single_dict({"uid": ["a"]}).pop(batch_keys=["x"])


def test_rename():
    data = make_data(2)
    assert data.rename("log_probs", "old_log_probs") is data
    data.rename(["uid", "flag"], ["group", "is_even"])
    assert "old_log_probs" in data.batch and "is_even" in data.batch and "group" in data.non_tensor_batch
    with pytest.raises(KeyError, match="'nope'"):
        data.rename("nope", "x")
    with pytest.raises(ValueError, match="'input_ids'"):
        data.rename("is_even", "input_ids")
    with pytest.raises(ValueError, match="2 new keys"):
        data.rename(["a"], ["b", "c"])


# ---------------------------------------------------------------------- union
def test_union_merges_in_place():
    data = make_data(3)
    extra = DataProto.from_dict(
        tensors={"values": torch.ones(3, 2), "input_ids": data.batch["input_ids"].clone()},
        non_tensors={"score": np.array([1.0, 2.0, 3.0])},
        meta_info={"temperature": 1.0, "step": 7},
    )
    assert data.union(extra) is data
    assert "values" in data.batch and data.non_tensor_batch["score"].tolist() == [1.0, 2.0, 3.0]
    assert data.meta_info == {"temperature": 1.0, "step": 7}
    only_objects = DataProto.from_single_dict({"uid": ["a", "b", "c"]}).union(
        make_data(3).select(batch_keys=["flag"], non_tensor_batch_keys=[])
    )
    assert only_objects.batch["flag"].tolist() == [True, False, True]
    assert len(DataProto().union(make_data(2))) == 2


def test_union_combines_metrics():
    data = make_data(2, meta={"metrics": {"timing/gen": 1.5}})
    data.union(
        DataProto.from_dict(
            {"values": torch.zeros(2)}, meta_info={"metrics": {"timing/gen": [2.5], "kl": 0.1}}
        )
    )
    assert data.meta_info == {"metrics": {"timing/gen": [1.5, 2.5], "kl": [0.1]}}


@pytest.mark.parametrize(
    ("other", "words"),
    [
        (DataProto.from_dict(tensors={"input_ids": torch.zeros(3, 4, dtype=torch.long)}), ["'input_ids'"]),
        (DataProto.from_dict(non_tensors={"uid": np.array(["x", "y", "z"], dtype=object)}), ["'uid'"]),
        (DataProto.from_dict(meta_info={"temperature": 0.5}), ["'temperature'", "0.5"]),
        (make_data(4), ["lengths differ", "3", "4"]),
    ],
)
def test_union_conflicts(other, words):
    data = make_data(3)
    with pytest.raises(ValueError) as info:
        data.union(other)
    for word in words:
        assert word in str(info.value)
    assert data.meta_info == {"temperature": 1.0} and "values" not in data.batch  # nothing changed


def test_union_checks_everything_before_changing():
    data = make_data(3)
    other = DataProto.from_dict({"values": torch.ones(3)}, meta_info={"temperature": 2.0})
    with pytest.raises(ValueError, match="'temperature'"):
        data.union(other)
    assert "values" not in data.batch


# ---------------------------------------------------------------------- concat
def test_concat_rows_and_meta():
    parts = [make_data(6)[0:2], make_data(6)[2:5], make_data(6)[5:6]]
    merged = DataProto.concat(parts)
    assert row_ids(merged) == list(range(6)) and merged.meta_info == {"temperature": 1.0}
    assert merged.batch["flag"].dtype == torch.bool
    only_objects = DataProto.concat([DataProto.from_single_dict({"uid": [i]}) for i in range(3)])
    assert only_objects.batch is None and only_objects.non_tensor_batch["uid"].tolist() == [0, 1, 2]


@pytest.mark.parametrize(
    ("metrics", "expected"),
    [
        ([{"loss": [1.0, 2.0]}, {"loss": [3.0], "kl": [0.1]}], {"loss": [1.0, 2.0, 3.0], "kl": [0.1]}),
        ([{"loss": 1.0}, {"loss": 2.0}], {"loss": [1.0, 2.0]}),
        ([[{"loss": 1.0}, {"loss": 2.0}], [{"loss": 3.0}]], {"loss": [1.0, 2.0, 3.0]}),
        ([{"loss": [1.0]}, None], {"loss": [1.0]}),
    ],
)
def test_concat_combines_metrics(metrics, expected):
    parts = []
    for i, metric in enumerate(metrics):
        meta = {"temperature": 1.0} if metric is None else {"temperature": 1.0, "metrics": metric}
        parts.append(DataProto.from_dict(tensors={"x": torch.tensor([i])}, meta_info=meta))
    assert DataProto.concat(parts).meta_info == {"temperature": 1.0, "metrics": expected}


@pytest.mark.parametrize(
    ("second", "error", "words"),
    [
        (DataProto.from_single_dict({"x": torch.zeros(1), "y": torch.zeros(1)}), ValueError, ["'y'"]),
        (DataProto.from_single_dict({"x": torch.zeros(1), "uid": ["a"]}), ValueError, ["uid"]),
        (DataProto.from_single_dict({"uid": ["a"]}), ValueError, ["batch is None", "1"]),
        (
            DataProto.from_dict({"x": torch.zeros(1)}, meta_info={"temperature": 2.0}),
            ValueError,
            ["'temperature'"],
        ),
        (DataProto.from_dict({"x": torch.zeros(1)}, meta_info={"metrics": 3.0}), TypeError, ["'metrics'"]),
        ("not data", TypeError, ["item 1"]),
    ],
)
def test_concat_errors(second, error, words):
    first = DataProto.from_dict(tensors={"x": torch.zeros(1)}, meta_info={"temperature": 1.0})
    with pytest.raises(error) as info:
        DataProto.concat([first, second])
    for word in words:
        assert word in str(info.value)
    with pytest.raises(ValueError, match="at least one"):
        DataProto.concat([])


# ---------------------------------------------------------------------- chunk / split / repeat / reorder
@pytest.mark.parametrize(("rows", "chunks"), [(6, 3), (6, 1), (6, 6), (0, 2)])
def test_chunk_equal(rows, chunks):
    pieces = make_data(rows).chunk(chunks)
    assert len(pieces) == chunks and {len(p) for p in pieces} == {rows // chunks}
    assert [i for p in pieces for i in row_ids(p)] == list(range(rows))
    assert all(p.meta_info == {"temperature": 1.0} for p in pieces)


def test_chunk_non_divisible_without_padding_is_error():
    with pytest.raises(ValueError, match="pad_dataproto_to_divisor"):
        make_data(5).chunk(2)
    with pytest.raises(ValueError, match="chunks must be a positive int"):
        make_data(4).chunk(0)


@pytest.mark.parametrize(
    ("rows", "chunks", "sizes"), [(7, 3, [3, 2, 2]), (2, 4, [1, 1, 0, 0]), (5, 5, [1] * 5)]
)
def test_chunk_with_padding_enabled_gives_near_equal_pieces(rows, chunks, sizes):
    data = make_data(rows, meta={DataProtoConfig.auto_padding_key: True})
    assert data.is_padding_enabled() and not make_data(rows).is_padding_enabled()
    pieces = data.chunk(chunks)
    assert [len(p) for p in pieces] == sizes
    assert [i for p in pieces for i in row_ids(p)] == list(range(rows))


def test_dispatch_style_pad_chunk_concat_unpad_round_trip():
    data = make_data(7, meta={DataProtoConfig.auto_padding_key: True})
    padded, pad_size = pad_dataproto_to_divisor(data, 4)
    assert pad_size == 1 and [len(p) for p in padded.chunk(4)] == [2, 2, 2, 2]
    collected = unpad_dataproto(DataProto.concat(padded.chunk(4)), pad_size)
    assert row_ids(collected) == list(range(7)) and collected.meta_info == data.meta_info


@pytest.mark.parametrize(
    ("rows", "divisor", "pad", "ids"),
    [
        (5, 4, 3, [0, 1, 2, 3, 4, 0, 1, 2]),
        (2, 7, 5, [0, 1, 0, 1, 0, 1, 0]),
        (4, 2, 0, [0, 1, 2, 3]),
        (0, 3, 0, []),
    ],
)
def test_pad_and_unpad(rows, divisor, pad, ids):
    data = make_data(rows, meta={"metrics": {"loss": [1.0]}})
    padded, pad_size = pad_dataproto_to_divisor(data, divisor)
    assert pad_size == pad and row_ids(padded) == ids
    assert padded.meta_info == {"metrics": {"loss": [1.0]}}  # padding must not duplicate metrics
    assert row_ids(unpad_dataproto(padded, pad_size)) == list(range(rows))


def test_pad_errors():
    with pytest.raises(ValueError, match="size_divisor"):
        pad_dataproto_to_divisor(make_data(3), 0)
    with pytest.raises(ValueError, match="pad_size"):
        unpad_dataproto(make_data(3), 4)
    with pytest.raises(ValueError, match="pad_size"):
        unpad_dataproto(make_data(0), 1)


def test_unpad_metrics_only_result_is_unchanged():
    metrics_only = DataProto.concat(
        [DataProto(meta_info={"metrics": {"loss": [float(i)]}}) for i in range(2)]
    )
    assert unpad_dataproto(metrics_only, 3) is metrics_only
    assert metrics_only.meta_info == {"metrics": {"loss": [0.0, 1.0]}}


def test_pad_non_tensor_only():
    data = DataProto.from_single_dict({"uid": ["a", "b", "c"]})
    padded, pad_size = pad_dataproto_to_divisor(data, 2)
    assert pad_size == 1 and padded.non_tensor_batch["uid"].tolist() == ["a", "b", "c", "a"]


@pytest.mark.parametrize(("rows", "size", "sizes"), [(7, 3, [3, 3, 1]), (6, 6, [6]), (2, 5, [2]), (0, 2, [])])
def test_split(rows, size, sizes):
    pieces = make_data(rows).split(size)
    assert [len(p) for p in pieces] == sizes
    assert [i for p in pieces for i in row_ids(p)] == list(range(rows))


@pytest.mark.parametrize(
    ("interleave", "expected"), [(True, [0, 0, 0, 1, 1, 1, 2, 2, 2]), (False, [0, 1, 2, 0, 1, 2, 0, 1, 2])]
)
def test_repeat(interleave, expected):
    repeated = make_data(3).repeat(repeat_times=3, interleave=interleave)
    assert row_ids(repeated) == expected
    with pytest.raises(ValueError, match="repeat_times"):
        make_data(3).repeat(0)


@pytest.mark.parametrize("counts", [[2, 0, 1], torch.tensor([2, 0, 1]), np.array([2, 0, 1])])
def test_sample_level_repeat(counts):
    assert row_ids(make_data(3).sample_level_repeat(counts)) == [0, 0, 2]


@pytest.mark.parametrize("counts", [[1, 2], [1, -1, 1], [1.5, 1, 1]])
def test_sample_level_repeat_errors(counts):
    with pytest.raises(ValueError, match="sample_level_repeat"):
        make_data(3).sample_level_repeat(counts)


@pytest.mark.parametrize("order", [[2, 0, 1], torch.tensor([2, 0, 1]), np.array([2, 0, 1])])
def test_reorder_in_place(order):
    data = make_data(3)
    assert data.reorder(order) is None
    assert row_ids(data) == [2, 0, 1]


@pytest.mark.parametrize("order", [[0, 0, 1], [0, 1]])
def test_reorder_needs_permutation(order):
    with pytest.raises(ValueError, match="permutation"):
        make_data(3).reorder(order)


# ---------------------------------------------------------------------- device and description
def test_to_moves_in_place():
    data = make_data(2)
    assert data.to("cpu") is data and data.batch["input_ids"].device.type == "cpu"
    assert DataProto.from_single_dict({"uid": ["a"]}).to("cpu").batch is None


def test_repr_and_data_info():
    data = make_data(2, meta={"temperature": 1.0, "metrics": {"loss": [0.5]}})
    data.batch["half"] = torch.zeros(2, 5, dtype=torch.bfloat16)
    text = repr(data)
    for word in [
        "len=2",
        "'input_ids': (2, 4) torch.int64 cpu",
        "'half': (2, 5) torch.bfloat16",
        "'uid': (2,) object",
    ]:
        assert word in text
    assert "metrics" in text and "temperature" in text
    info = data.get_data_info()
    assert "input_ids: shape=(2, 4) dtype=torch.int64 device=cpu bytes=64" in info
    assert "reward_model: shape=(2,) dtype=object" in info and "temperature: 1.0" in info
    assert "batch=None" in repr(DataProto.from_single_dict({"uid": ["a"]}))
