"""Tensors unpickled from read-only buffers (Ray's object store) are used in place until `batch` is
read, then copied: a receiver that writes never reaches memory other readers share.

`in_place(data, key)` peeks at the stored tensor without the copy that reading `batch` makes; it is
how these tests tell "still in the sender's memory" from "copied"."""

import copy
import pickle
import warnings

import numpy as np
import pytest
import torch

from hybridflow.protocol import DataProto, pad_dataproto_to_divisor, unpad_dataproto

ROWS = 8


def make_data(rows: int = ROWS, width: int = 4) -> DataProto:
    r = torch.arange(rows)
    return DataProto.from_dict(
        tensors={
            "x": r[:, None] * 100 + torch.arange(width),  # (B, W) int64
            "w": r.float()[:, None].repeat(1, width) / 4,  # (B, W) float32
            "half": r.to(torch.bfloat16)[:, None].repeat(1, width),  # (B, W) bfloat16, sent as int16
        },
        non_tensors={"uid": [f"u{i}" for i in range(rows)]},
        meta_info={"temperature": 0.7},
    )


def load_read_only(data: DataProto) -> DataProto:
    """Unpickle with read-only out-of-band buffers over the sender's memory, as Ray does."""
    buffers = []
    payload = pickle.dumps(data, protocol=5, buffer_callback=buffers.append)
    return pickle.loads(payload, buffers=[b.raw().toreadonly() for b in buffers])


def in_place(data: DataProto, key: str) -> torch.Tensor:
    return data._batch[key]  # the stored tensor, without the copy that `data.batch` makes


def assert_values(data: DataProto, rows: list[int]) -> None:
    assert data.batch["x"][:, 0].tolist() == [100 * r for r in rows]
    assert data.batch["w"][:, 0].tolist() == [r / 4 for r in rows]
    assert data.batch["half"][:, 0].tolist() == [float(r) for r in rows]
    assert data.non_tensor_batch["uid"].tolist() == [f"u{r}" for r in rows]


# ---------------------------------------------------------------------- without Ray
def test_read_only_buffers_are_used_in_place_until_batch_is_read():
    sender = make_data()
    received = load_read_only(sender)
    for key in ["x", "w", "half"]:
        assert in_place(received, key).data_ptr() == sender.batch[key].data_ptr(), key
    assert len(received) == ROWS and "read-only memory" in received.get_data_info()
    assert received.to("cpu") is received  # already there: still in place
    assert in_place(received, "x").data_ptr() == sender.batch["x"].data_ptr()
    tensors = received.batch  # first read: private copies
    for key in ["x", "w", "half"]:
        assert tensors[key].data_ptr() != sender.batch[key].data_ptr(), key
    tensors["x"].add_(1)
    tensors["half"].mul_(2)
    assert sender.batch["x"][:, 0].tolist() == [100 * r for r in range(ROWS)]
    assert sender.batch["half"][:, 0].tolist() == [float(r) for r in range(ROWS)]
    assert received.batch["x"][:, 0].tolist() == [100 * r + 1 for r in range(ROWS)]
    assert "read-only memory" not in received.get_data_info()


def test_writable_buffers_are_never_copied():
    sender = make_data()
    buffers = []
    payload = pickle.dumps(sender, protocol=5, buffer_callback=buffers.append)
    received = pickle.loads(payload, buffers=buffers)  # writable buffers: the receiver owns them
    assert received.batch["x"].data_ptr() == sender.batch["x"].data_ptr()
    in_band = pickle.loads(pickle.dumps(sender, protocol=5))
    assert in_place(in_band, "x").data_ptr() == in_band.batch["x"].data_ptr()  # no second copy


def test_torch_does_not_warn_about_read_only_arrays():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_read_only(make_data())


@pytest.mark.parametrize(
    ("view", "rows"),
    [
        (lambda d: d.chunk(4)[1], [2, 3]),
        (lambda d: d.split(3)[2], [6, 7]),
        (lambda d: d[2:5], [2, 3, 4]),
        (lambda d: d.slice(0, 8, 4), [0, 4]),
        (lambda d: d.select(batch_keys=["x", "w", "half"]), list(range(ROWS))),
        (lambda d: unpad_dataproto(d, 3), list(range(5))),
    ],
)
def test_views_stay_in_place_and_copy_on_first_read(view, rows):
    sender = make_data()
    received = load_read_only(sender)
    part = view(received)
    assert in_place(part, "x").data_ptr() == sender.batch["x"][rows[0]].data_ptr()  # a view, no copy
    assert_values(part, rows)
    part.batch["x"].fill_(-1)
    part.batch["half"].fill_(-1)
    assert_values(sender, list(range(ROWS)))
    assert_values(received, list(range(ROWS)))


@pytest.mark.parametrize(
    ("operation", "rows"),
    [
        (lambda d: DataProto.concat(d.chunk(2)), list(range(ROWS))),
        (lambda d: d.repeat(2)[:4], [0, 0, 1, 1]),
        (lambda d: d.select_idxs([5, 1]), [5, 1]),
        (lambda d: d[[3, 3]], [3, 3]),
        (lambda d: copy.deepcopy(d), list(range(ROWS))),
        (lambda d: d.select(deepcopy=True), list(range(ROWS))),
        (lambda d: pad_dataproto_to_divisor(d[:7], 4)[0], [0, 1, 2, 3, 4, 5, 6, 0]),
        (lambda d: d.sample_level_repeat([1] + [0] * (ROWS - 1)), [0]),
    ],
)
def test_operations_that_copy_give_writable_results(operation, rows):
    sender = make_data()
    result = operation(load_read_only(sender))
    assert in_place(result, "x").data_ptr() != sender.batch["x"].data_ptr()
    assert_values(result, rows)
    result.batch["x"].fill_(-1)
    assert_values(sender, list(range(ROWS)))


def test_item_rows_are_private_copies():
    sender = make_data()
    received = load_read_only(sender)
    item = received[3]
    assert item.batch["x"].tolist() == [300, 301, 302, 303] and item.non_tensor_batch["uid"] == "u3"
    item.batch["x"].fill_(-1)
    item.batch["w"].fill_(-1)
    assert_values(received, list(range(ROWS)))


def test_reorder_union_pop_rename_keep_track_of_what_is_in_place():
    sender = make_data()
    received = load_read_only(sender)
    received.reorder([1, 0, 2, 3, 4, 5, 6, 7])
    assert_values(received, [1, 0, 2, 3, 4, 5, 6, 7])

    local = DataProto.from_dict(tensors={"y": torch.zeros(ROWS)}, meta_info={"temperature": 0.7})
    local.union(load_read_only(sender))  # local now holds the sender's tensors in place
    assert in_place(local, "x").data_ptr() == sender.batch["x"].data_ptr()
    local.batch["x"].fill_(-1)
    local.batch["y"].fill_(2)
    assert_values(sender, list(range(ROWS)))

    received = load_read_only(sender)
    received.rename("x", "tokens")
    assert in_place(received, "tokens").data_ptr() == sender.batch["x"].data_ptr()
    popped = received.pop(batch_keys=["tokens"])
    assert in_place(popped, "tokens").data_ptr() == sender.batch["x"].data_ptr()
    popped.batch["tokens"].fill_(-1)
    received.batch["w"].fill_(-1)
    assert_values(sender, list(range(ROWS)))
    assert sorted(received.batch.keys()) == ["half", "w"]


def test_forwarding_borrowed_data_sends_the_same_values():
    sender = make_data()
    forwarded = load_read_only(load_read_only(sender).chunk(2)[1])
    assert in_place(forwarded, "x").data_ptr() == sender.batch["x"][4].data_ptr()
    assert_values(forwarded, [4, 5, 6, 7])
    for protocol in (4, 5):  # in band: loads into memory of its own, used without another copy
        copied = pickle.loads(pickle.dumps(load_read_only(sender), protocol=protocol))
        assert in_place(copied, "x").data_ptr() == copied.batch["x"].data_ptr()
        assert_values(copied, list(range(ROWS)))


def test_assigning_batch_replaces_in_place_tensors():
    sender = make_data()
    received = load_read_only(sender)
    received.batch = make_data(2).batch
    assert len(received.batch.keys()) == 3 and received.batch["x"][:, 0].tolist() == [0, 100]


# ---------------------------------------------------------------------- real Ray object store
def test_ray_get_shares_object_store_memory_until_batch_is_read(ray_cluster):
    sender = make_data(rows=4096, width=64)  # 2 MiB per int64 tensor: stored in shared memory
    ref = ray_cluster.put(sender)
    first, second = ray_cluster.get(ref), ray_cluster.get(ref)
    shared = in_place(first, "x")
    assert shared.data_ptr() == in_place(second, "x").data_ptr() != sender.batch["x"].data_ptr()
    first.batch["x"].add_(1)  # copies first, then writes the copy
    assert torch.equal(in_place(second, "x"), sender.batch["x"])
    assert torch.equal(ray_cluster.get(ref).batch["x"], sender.batch["x"])
    assert torch.equal(first.batch["x"], sender.batch["x"] + 1)


def test_ray_actor_writing_in_place_leaves_the_object_for_other_readers(ray_cluster):
    @ray_cluster.remote(num_cpus=0)
    class Receiver:
        def write_then_sum(self, data: DataProto) -> float:
            data.batch["w"].mul_(-1)
            data[0].batch["x"].fill_(-7)
            return float(data.batch["w"].sum())

        def forward_chunk(self, data: DataProto) -> DataProto:
            return data.chunk(2)[1]

        def sums(self, data: DataProto) -> tuple[int, float]:
            return int(data.batch["x"].sum()), float(data.batch["w"].sum())

    sender = make_data(rows=4096, width=64)
    ref = ray_cluster.put(sender)
    writer, reader = Receiver.remote(), Receiver.remote()
    expected = (int(sender.batch["x"].sum()), float(sender.batch["w"].sum()))
    assert ray_cluster.get(writer.write_then_sum.remote(ref)) == -expected[1]
    assert ray_cluster.get(reader.sums.remote(ref)) == expected
    assert ray_cluster.get(writer.sums.remote(ref)) == expected
    half = ray_cluster.get(reader.forward_chunk.remote(ref))
    assert torch.equal(half.batch["x"], sender.batch["x"][2048:])
    assert np.array_equal(half.non_tensor_batch["uid"], sender.non_tensor_batch["uid"][2048:])
