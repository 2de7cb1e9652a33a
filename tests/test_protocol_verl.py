"""Code written against verl's DataProto runs unchanged: each convention verl users rely on, and the
strict errors on genuinely malformed input that remain."""

import numpy as np
import pytest
import torch

from hybridflow.protocol import DataProto, DataProtoConfig, DataProtoConflictError


def tokens(rows: int) -> dict[str, torch.Tensor]:
    return {"input_ids": torch.arange(rows * 2).view(rows, 2)}  # (B, 2), row i = [2i, 2i + 1]


# ---------------------------------------------------------------------- per-sample lists
def test_from_dict_turns_lists_into_one_object_per_sample():
    data = DataProto.from_dict(
        tensors=tokens(3),
        non_tensors={
            "labels": ["a", "b", "c"],
            "messages": [[{"role": "user"}], [{"role": "tool"}], [{"role": "user"}]],
            "pairs": ([1, 2], [3, 4], [5, 6]),  # equal-length entries must not become a 2-D array
        },
    )
    assert len(data) == 3
    for key in ["labels", "messages", "pairs"]:
        assert data.non_tensor_batch[key].dtype == object and data.non_tensor_batch[key].shape == (3,), key
    assert data[1].non_tensor_batch == {"labels": "b", "messages": [{"role": "tool"}], "pairs": [3, 4]}
    assert data[[2, 0]].non_tensor_batch["labels"].tolist() == ["c", "a"]
    only_lists = DataProto.from_dict(non_tensors={"labels": ["x", "y"]})
    assert only_lists.batch is None and len(only_lists) == 2


def test_a_list_of_the_wrong_length_is_still_an_error():
    with pytest.raises(ValueError, match=r"'labels'\] has 2 rows but batch has 3"):
        DataProto.from_dict(tensors=tokens(3), non_tensors={"labels": ["a", "b"]})


# ---------------------------------------------------------------------- None parts
def test_none_parts_are_empty():
    data = DataProto(batch=None, non_tensor_batch=None, meta_info={"step": 3})
    assert len(data) == 0 and data.batch is None
    assert data.non_tensor_batch == {} and data.meta_info == {"step": 3}
    empty = DataProto(None, None, None)
    assert empty.non_tensor_batch == {} and empty.meta_info == {}
    empty.non_tensor_batch["uid"] = np.array(["a"], dtype=object)  # an owned dict, not shared
    assert DataProto(None, None, None).non_tensor_batch == {}
    merged = DataProto.concat([DataProto(meta_info={"step": 3}), data])
    assert len(merged) == 0 and merged.meta_info == {"step": 3}


# ---------------------------------------------------------------------- auto_padding=
@pytest.mark.parametrize("builder", ["from_dict", "from_single_dict"])
def test_auto_padding_argument_enables_uneven_chunks(builder):
    meta = {"temperature": 0.7}
    if builder == "from_dict":
        data = DataProto.from_dict(tensors=tokens(5), meta_info=meta, auto_padding=True)
    else:
        data = DataProto.from_single_dict(tokens(5), meta_info=meta, auto_padding=True)
    assert data.is_padding_enabled() and data.meta_info[DataProtoConfig.auto_padding_key] is True
    assert [len(piece) for piece in data.chunk(2)] == [3, 2]
    assert meta == {"temperature": 0.7}  # the caller's dict is not modified
    assert not DataProto.from_dict(tensors=tokens(5), auto_padding=False).is_padding_enabled()


def test_num_batch_dims_other_than_one_is_refused():
    assert len(DataProto.from_dict(tensors=tokens(2), num_batch_dims=1)) == 2
    with pytest.raises(ValueError, match=r"num_batch_dims must be 1.*got 2"):
        DataProto.from_dict(tensors=tokens(2), num_batch_dims=2)


# ---------------------------------------------------------------------- conflicts, caught the verl way
def test_concat_meta_info_conflict_is_an_assertion_error_naming_the_key():
    parts = [DataProto.from_dict(tokens(1), meta_info={"temperature": t}) for t in (1.0, 0.5)]
    with pytest.raises(AssertionError, match=r"Conflicting values for meta_info key 'temperature'") as info:
        DataProto.concat(parts)
    assert isinstance(info.value, ValueError) and isinstance(info.value, DataProtoConflictError)
    assert "1.0" in str(info.value) and "0.5" in str(info.value)


@pytest.mark.parametrize(
    ("other", "key"),
    [
        (DataProto.from_dict(tensors={"input_ids": torch.zeros(3, 2, dtype=torch.long)}), "'input_ids'"),
        (DataProto.from_dict(non_tensors={"uid": ["x", "y", "q"]}), "'uid'"),
        (DataProto.from_dict(meta_info={"temperature": 0.5}), "'temperature'"),
        (DataProto.from_dict(tensors=tokens(4)), "lengths differ"),
    ],
)
def test_union_conflicts_are_assertion_errors_naming_the_key(other, key):
    data = DataProto.from_dict(
        tokens(3), non_tensors={"uid": ["x", "y", "z"]}, meta_info={"temperature": 1.0}
    )
    with pytest.raises(AssertionError) as info:
        data.union(other)
    assert isinstance(info.value, ValueError) and key in str(info.value)


# ---------------------------------------------------------------------- verl's other helpers
def test_select_idxs_and_slice_match_indexing():
    data = DataProto.from_dict(tokens(5), non_tensors={"uid": [f"u{i}" for i in range(5)]})
    for idxs in ([3, 1], np.array([3, 1]), torch.tensor([3, 1]), [False, True, False, True, False]):
        picked = data.select_idxs(idxs)
        assert sorted(picked.non_tensor_batch["uid"].tolist()) == ["u1", "u3"]
        assert (picked.batch["input_ids"][:, 0] // 2).tolist() == [
            int(u[1]) for u in picked.non_tensor_batch["uid"]
        ]
    sliced = data.slice(1, 4)
    assert sliced.batch["input_ids"][:, 0].tolist() == [2, 4, 6]
    assert sliced.batch["input_ids"].data_ptr() == data.batch["input_ids"][1].data_ptr()  # a view
    assert data.slice(None, None, 2).non_tensor_batch["uid"].tolist() == ["u0", "u2", "u4"]


def test_make_iterator_covers_every_row_each_epoch():
    data = DataProto.from_dict(tokens(6), meta_info={"temperature": 0.7})
    batches = list(data.make_iterator(mini_batch_size=2, epochs=3))
    assert len(batches) == 9 and all(len(b) == 2 and b.meta_info == {"temperature": 0.7} for b in batches)
    rows = [(b.batch["input_ids"][:, 0] // 2).tolist() for b in batches]
    assert rows[:3] == [[0, 1], [2, 3], [4, 5]] and rows[3:6] == rows[:3]  # no shuffle: in order
    shuffled = [
        [
            r
            for b in data.make_iterator(2, 2, seed=7, dataloader_kwargs={"shuffle": True})
            for r in b.batch["input_ids"][:, 0].tolist()
        ]
        for _ in range(2)
    ]
    assert shuffled[0] == shuffled[1]  # the seed fixes the order
    assert sorted(shuffled[0][:6]) == sorted(shuffled[0][6:]) == [0, 2, 4, 6, 8, 10]
    assert shuffled[0][:6] != [0, 2, 4, 6, 8, 10] or shuffled[0][6:] != [0, 2, 4, 6, 8, 10]
    with pytest.raises(ValueError, match=r"mini_batch_size 4 does not divide.*6 rows"):
        data.make_iterator(mini_batch_size=4, epochs=1)


def test_print_size(capsys):
    data = DataProto.from_dict(
        {"x": torch.zeros(4, 2**18, dtype=torch.float32)},  # 4 MiB
        non_tensors={"score": np.zeros(4, dtype=np.float64)},  # 32 bytes
    )
    data.print_size(prefix="rollout")
    assert capsys.readouterr().out.strip() == (
        f"rollout, Size of tensordict: {4 / 1024} GB, size of non_tensor_batch: {32 / 2**30} GB"
    )


# ---------------------------------------------------------------------- strictness kept
@pytest.mark.parametrize(
    ("build", "error", "words"),
    [
        (lambda: DataProto.from_dict({"a": torch.zeros(3), "b": torch.zeros(4)}), ValueError, ["'b'", "'a'"]),
        (lambda: DataProto.from_dict({"a": torch.zeros(3)}, {"uid": np.array(["x"])}), ValueError, ["'uid'"]),
        (lambda: DataProto.from_dict(non_tensors={"uid": np.array("x")}), ValueError, ["'uid'", "0-dim"]),
        (lambda: DataProto.from_dict(non_tensors={"uid": "abc"}), TypeError, ["'uid'", "str"]),
        (lambda: DataProto(non_tensor_batch={"uid": ["a", "b"]}), TypeError, ["'uid'", "from_dict"]),
        (lambda: DataProto(non_tensor_batch=[("uid", np.zeros(2))]), TypeError, ["non_tensor_batch", "list"]),
    ],
)
def test_malformed_input_still_raises(build, error, words):
    with pytest.raises(error) as info:
        build()
    for word in words:
        assert word in str(info.value)
