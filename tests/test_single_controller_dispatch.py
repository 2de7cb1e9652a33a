"""RayWorkerGroup on 8 real Ray actors: SPMD environment, every dispatch mode, futures, failures.

One group for the whole module, laid out as Megatron would: dp 2 x pp 2 x tp 2, ranks in
Megatron's order (tp fastest, then dp, then pp). With that order, rank r has tp = r % 2,
dp = (r // 2) % 2, pp = r // 4; the collect ranks (tp 0, last pp stage) are 4 (dp 0) and 6 (dp 1).
"""

import pytest
import ray
import torch
from single_controller_workers import ProbeWorker, megatron_order

from hybridflow.protocol import DataProto, DataProtoConfig, DataProtoFuture
from hybridflow.single_controller import (
    RayClassWithInitArgs,
    RayResourcePool,
    RayWorkerGroup,
    UnregisteredMethodError,
    WorkerError,
)

WORLD, DP, TP, PP = 8, 2, 2, 2


@pytest.fixture(scope="module")
def group(ray_cluster):
    pool = RayResourcePool([WORLD], name_prefix="test_dispatch")
    worker_group = RayWorkerGroup(pool, RayClassWithInitArgs(ProbeWorker, "probe"))
    worker_group.register_megatron_ranks(DP, TP, PP)
    yield worker_group
    worker_group.shutdown()
    pool.release()


@pytest.fixture(autouse=True)
def forget_received(group):
    group.take_received()


@pytest.fixture
def put_counter(monkeypatch):
    """Counts ray.put calls made by the driver during a test."""
    calls = []
    real_put = ray.put

    def counting_put(value, **kwargs):
        calls.append(value)
        return real_put(value, **kwargs)

    monkeypatch.setattr(ray, "put", counting_put)
    return calls


def batch(rows: int, padding: bool = False) -> DataProto:
    meta = {DataProtoConfig.auto_padding_key: True} if padding else {}
    return DataProto.from_dict({"x": torch.arange(rows)}, meta_info=meta)


def received(group) -> list:
    return group.take_received()


def test_spmd_env_lets_torch_distributed_all_reduce_on_gloo(group):
    envs = group.env()
    assert [e["RANK"] for e in envs] == [str(r) for r in range(WORLD)]
    assert [e["rank_attr"] for e in envs] == list(range(WORLD))
    assert {e["WORLD_SIZE"] for e in envs} == {str(WORLD)}
    assert [e["LOCAL_RANK"] for e in envs] == [str(r) for r in range(WORLD)]  # one node
    assert {e["MASTER_ADDR"] for e in envs} == {ray.util.get_node_ip_address()}
    assert len({e["MASTER_PORT"] for e in envs}) == 1
    assert len({e["pid"] for e in envs}) == WORLD  # one process per slot
    assert {e["tag"] for e in envs} == {"probe"}  # init args reached every rank
    assert group.all_reduce_rank_plus_one() == [float(sum(range(1, WORLD + 1)))] * WORLD


def test_one_to_all_all_to_all_rank_zero_and_dp_compute(group):
    assert group.echo("v", key="k") == [(r, "v", "k") for r in range(WORLD)]
    assert group.per_rank(list("abcdefgh")) == list(zip(range(WORLD), "abcdefgh", strict=True))
    assert group.on_rank_zero("only") == (0, "only")
    assert group.dp_compute(list(range(10, 18))) == [(r, 10 + r) for r in range(WORLD)]


def test_dp_compute_proto_splits_by_world_size(group, put_counter):
    out = group.double(batch(16))
    assert out.batch["x"].tolist() == [2 * i for i in range(16)]
    assert out.batch["rank"].tolist() == [i // 2 for i in range(16)]
    assert received(group) == [[[2 * r, 2 * r + 1]] for r in range(WORLD)]
    assert len(put_counter) == WORLD  # one put per chunk


def test_dp_compute_proto_auto_pads_and_strips_padding(group):
    out = group.double(batch(10, padding=True))  # padded to 16 = 2 rows per rank
    assert out.batch["x"].tolist() == [2 * i for i in range(10)]
    assert out.batch["rank"].tolist() == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]
    # Padding rows repeat the batch from its start: ranks 5..7 compute rows 10..15 = rows 0..5.
    assert received(group)[5:] == [[[0, 1]], [[2, 3]], [[4, 5]]]


def test_dp_compute_proto_with_func_and_metric(group):
    out = group.apply(lambda x: x * x + 1, batch(8))
    assert out.batch["x"].tolist() == [i * i + 1 for i in range(8)]
    assert received(group) == [[[r]] for r in range(WORLD)]
    metrics = group.metric(batch(9, padding=True))  # padded to 16; metrics are not unpadded
    assert [m["rank"] for m in metrics] == list(range(WORLD))
    assert [m["rows"] for m in metrics] == [2] * WORLD
    assert received(group)[4] == [[8, 0]]  # row 8, then the first padding row (row 0 again)


def test_megatron_compute_gives_dp_items_and_collects_pp_last_tp_zero(group):
    assert group.megatron(["for dp0", "for dp1"]) == [(4, "for dp0"), (6, "for dp1")]


def test_megatron_compute_proto_routes_chunks_collects_in_dp_order_and_puts_once(group, put_counter):
    out = group.times_ten(batch(8))
    assert out.batch["x"].tolist() == [10 * i for i in range(8)]
    assert out.batch["rank"].tolist() == [4] * 4 + [6] * 4  # tp 0, last pp stage, dp order
    got = received(group)
    for rank in range(WORLD):
        dp = megatron_order(rank, DP, TP, PP)["dp"]
        assert got[rank] == [[4 * dp + i for i in range(4)]], f"rank {rank}"
    assert len(put_counter) == DP  # one object per dp chunk, shared by its 4 tp/pp ranks


def test_megatron_compute_proto_auto_pads(group):
    out = group.times_ten(batch(5, padding=True))
    assert out.batch["x"].tolist() == [10 * i for i in range(5)]
    assert out.batch["rank"].tolist() == [4, 4, 4, 6, 6]


def test_megatron_pp_as_dp_proto_uses_dp_times_pp_chunks(group, put_counter):
    out = group.pp_as_dp(batch(8))
    assert out.batch["x"].tolist() == [10 * i for i in range(8)]
    # Chunk index dp * pp_size + pp: chunks 0..3 are on ranks 0 (dp0 pp0), 4 (dp0 pp1), 2, 6.
    assert out.batch["rank"].tolist() == [0, 0, 4, 4, 2, 2, 6, 6]
    got = received(group)
    for rank in range(WORLD):
        order = megatron_order(rank, DP, TP, PP)
        chunk = order["dp"] * PP + order["pp"]
        assert got[rank] == [[2 * chunk, 2 * chunk + 1]], f"rank {rank}"
    assert len(put_counter) == DP * PP


def test_custom_dispatch_and_collect(group):
    # Rank i gets 100 * i + 1 and returns it + i; the custom collect sums.
    assert group.custom(1) == sum(100 * i + 1 + i for i in range(WORLD))


def test_non_blocking_future_feeds_next_call_without_driver_fetch(group, monkeypatch):
    future = group.plus_one_later(batch(8))
    assert isinstance(future, DataProtoFuture)
    fetched = []
    real_get = ray.get

    def recording_get(refs, **kwargs):
        fetched.extend(refs if isinstance(refs, list) else [refs])
        return real_get(refs, **kwargs)

    monkeypatch.setattr(ray, "get", recording_get)
    out = group.times_ten(future)
    assert out.batch["x"].tolist() == [10 * (i + 1) for i in range(8)]
    assert not set(future.futures) & set(fetched)  # workers resolved the future themselves
    monkeypatch.undo()
    padded = group.plus_one_later(batch(7, padding=True)).get()
    assert padded.batch["x"].tolist() == [i + 1 for i in range(7)]


def test_worker_exception_keeps_type_and_names_rank_and_method(group):
    with pytest.raises(ValueError, match="bad value") as info:
        group.fail_on(3, "bad value")
    assert isinstance(info.value, WorkerError)
    assert info.value.rank == 3
    assert "rank 3" in str(info.value) and "fail_on" in str(info.value)
    assert group.echo(1)[3] == (3, 1, None)  # the group is still usable


def test_misuse_fails_before_anything_is_sent(group, monkeypatch):
    def must_not_run(*args, **kwargs):
        raise AssertionError("a misused call reached the workers")

    monkeypatch.setattr(group, "_execute", must_not_run)
    with pytest.raises(ValueError, match=r"DP_COMPUTE expects .* one item per rank \(the world size, 8\)"):
        group.dp_compute([1, 2, 3])
    with pytest.raises(ValueError, match="data-parallel size, 2"):
        group.megatron(["a", "b", "c"])
    with pytest.raises(ValueError, match="not divisible by 8"):
        group.double(batch(10))  # no auto-padding enabled
    with pytest.raises(TypeError, match="expected DataProto or DataProtoFuture"):
        group.double([1, 2])
    with pytest.raises(UnregisteredMethodError, match=r"not_registered is not decorated with @register"):
        group.not_registered()
