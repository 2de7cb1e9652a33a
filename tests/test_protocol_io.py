"""DataProto serialisation, Ray futures and torch.distributed all-gather (real Ray, real gloo)."""

import copy
import pickle

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hybridflow.protocol import DataProto, DataProtoFuture, all_gather_data_proto


def make_data(rows: int, start: int = 0, meta: dict | None = None) -> DataProto:
    r = torch.arange(start, start + rows)
    return DataProto.from_single_dict(
        {
            "input_ids": r[:, None] * 10 + torch.arange(4),  # (B, 4) int64
            "log_probs": r.float()[:, None] / 3,  # (B, 1) float32
            "half": r.to(torch.bfloat16)[:, None].repeat(1, 2) / 7,  # (B, 2) bfloat16
            "mask": r % 2 == 0,  # (B,) bool
            "uid": [f"u{i}" for i in r.tolist()],
            "reward_model": [{"ground_truth": [i, str(i)]} for i in r.tolist()],
            "score": np.arange(start, start + rows, dtype=np.float64),
        },
        meta_info=meta if meta is not None else {"temperature": 0.7},
    )


def assert_same(a: DataProto, b: DataProto) -> None:
    assert len(a) == len(b) and a.meta_info == b.meta_info
    assert (a.batch is None) == (b.batch is None)
    if a.batch is not None:
        assert list(a.batch.keys()) == list(b.batch.keys())
        for key, value in a.batch.items():
            assert value.dtype == b.batch[key].dtype, key
            assert torch.equal(value, b.batch[key]), key
    assert list(a.non_tensor_batch) == list(b.non_tensor_batch)
    for key, value in a.non_tensor_batch.items():
        assert value.dtype == b.non_tensor_batch[key].dtype, key
        assert value.tolist() == b.non_tensor_batch[key].tolist(), key


# ---------------------------------------------------------------------- pickle and disk
@pytest.mark.parametrize("protocol", [4, 5])
@pytest.mark.parametrize("rows", [0, 1, 5])
def test_pickle_round_trip(protocol, rows):
    data = make_data(rows, meta={"temperature": 0.7, "metrics": {"loss": [1.0]}})
    restored = pickle.loads(pickle.dumps(data, protocol=protocol))
    assert_same(data, restored)
    restored.batch["input_ids"].add_(1)  # restored tensors own writable memory
    assert data.batch["input_ids"].sum() == sum(i * 40 + 6 for i in range(rows))


def test_pickle_non_tensor_only_and_non_contiguous():
    only_objects = DataProto.from_single_dict({"uid": ["a", "b"]}, meta_info={"k": 1})
    assert_same(only_objects, pickle.loads(pickle.dumps(only_objects)))
    transposed = DataProto.from_dict(tensors={"t": torch.arange(12).view(3, 4).t()})  # (4, 3) non-contiguous
    assert torch.equal(pickle.loads(pickle.dumps(transposed)).batch["t"], transposed.batch["t"])


def test_pickled_chunk_carries_only_its_rows():
    data = DataProto.from_dict(tensors={"x": torch.zeros(64, 1024)})
    full = len(pickle.dumps(data, protocol=5))
    quarter = len(pickle.dumps(data.chunk(4)[1], protocol=5))
    assert full > 64 * 1024 * 4 and quarter < full / 3


def test_out_of_band_buffers_are_used():
    data = make_data(8)
    buffers = []
    payload = pickle.dumps(data, protocol=5, buffer_callback=buffers.append)
    assert len(buffers) >= len(data.batch.keys())
    restored = pickle.loads(payload, buffers=buffers)
    assert_same(data, restored)


def test_deepcopy_keeps_values_and_detaches():
    data = make_data(3)
    clone = copy.deepcopy(data)
    assert_same(data, clone)
    clone.batch["input_ids"][0, 0] = -5
    clone.non_tensor_batch["reward_model"][0]["ground_truth"].append("x")
    assert (
        data.batch["input_ids"][0, 0] == 0
        and len(data.non_tensor_batch["reward_model"][0]["ground_truth"]) == 2
    )


def test_save_and_load_from_disk(tmp_path):
    data = make_data(4, meta={"temperature": 0.7, "metrics": {"loss": [1.0, 2.0]}})
    path = tmp_path / "batch.pkl"
    data.save_to_disk(path)
    assert_same(data, DataProto.load_from_disk(path))
    data[:2].save_to_disk(str(path))  # overwrite through the same atomic rename
    assert len(DataProto.load_from_disk(path)) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["batch.pkl"]  # no temporary file left
    with open(tmp_path / "other.pkl", "wb") as f:
        pickle.dump({"not": "data"}, f)
    with pytest.raises(TypeError, match=r"other\.pkl.*dict"):
        DataProto.load_from_disk(tmp_path / "other.pkl")


def test_failed_save_leaves_old_file(tmp_path):
    path = tmp_path / "batch.pkl"
    make_data(2).save_to_disk(path)
    bad = make_data(2)
    bad.meta_info["callback"] = lambda: None  # not picklable
    with pytest.raises((pickle.PicklingError, AttributeError)):
        bad.save_to_disk(path)
    assert len(DataProto.load_from_disk(path)) == 2 and len(list(tmp_path.iterdir())) == 1


# ---------------------------------------------------------------------- Ray
def test_ray_put_get_gives_writable_tensors(ray_cluster):
    data = make_data(5)
    restored = ray_cluster.get(ray_cluster.put(data))
    assert_same(data, restored)
    restored.batch["log_probs"].mul_(2)  # would crash on read-only object-store memory
    assert torch.equal(restored.batch["log_probs"], data.batch["log_probs"] * 2)


def test_future_concat_and_chunk(ray_cluster):
    parts = [make_data(2, start=0), make_data(3, start=2), make_data(1, start=5)]
    expected = DataProto.concat(parts)
    future = DataProtoFuture.concat([ray_cluster.put(p) for p in parts])
    assert_same(expected, future.get())
    chunks = future.chunk(3)
    for i, chunk in enumerate(chunks):
        assert_same(expected.chunk(3)[i], chunk.get())
    nested = chunks[1].chunk(2)  # chunking a chunked future composes the dispatches
    assert_same(expected.chunk(3)[1].chunk(2)[1], nested[1].get())

    @ray_cluster.remote
    def resolve_in_task(fut: DataProtoFuture) -> DataProto:
        return fut.get()

    assert_same(expected.chunk(3)[2], ray_cluster.get(resolve_in_task.remote(chunks[2])))


def test_future_errors(ray_cluster):
    with pytest.raises(TypeError, match="item 0"):
        DataProtoFuture.concat([make_data(1)])
    with pytest.raises(TypeError, match=r"ref 0.*dict"):
        DataProtoFuture.concat([ray_cluster.put({"x": 1})]).get()


# ---------------------------------------------------------------------- torch.distributed
def _all_gather_worker(rank: int, world_size: int, store: str) -> None:
    # a file store: no port to find free and hand on, which another process could take meanwhile
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
    try:
        lengths, starts = [2, 3], [0, 2]
        local = make_data(
            lengths[rank], start=starts[rank], meta={"temperature": 0.7, "metrics": {"rank": [rank]}}
        )
        before = copy.deepcopy(local)
        for group in (None, dist.new_group(list(range(world_size)))):
            gathered = all_gather_data_proto(local, process_group=group)
            expected = make_data(5, meta={"temperature": 0.7, "metrics": {"rank": [0, 1]}})
            assert_same(expected, gathered)
        assert_same(before, local)  # the input is left unchanged
        objects_only = DataProto.from_single_dict({"uid": [f"r{rank}"] * (rank + 1)})
        assert all_gather_data_proto(objects_only).non_tensor_batch["uid"].tolist() == ["r0", "r1", "r1"]
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_all_gather_data_proto_gloo(tmp_path):
    mp.spawn(_all_gather_worker, args=(2, str(tmp_path / "store")), nprocs=2, join=True)
