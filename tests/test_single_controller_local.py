"""LocalWorkerGroup runs the same worker methods in this process, through the same dispatch code,
plus the checks `register` and `Worker` make without any worker group. No Ray needed."""

import pytest
import torch
from single_controller_workers import ActorRole, CriticRole, ProbeWorker, TeardownRole

from hybridflow.protocol import DataProto, DataProtoConfig
from hybridflow.single_controller import (
    Dispatch,
    Execute,
    LocalWorkerGroup,
    RayClassWithInitArgs,
    RayResourcePool,
    UnregisteredMethodError,
    Worker,
    create_colocated_worker_cls,
    register,
)


@pytest.fixture
def spmd_env_restored(monkeypatch):
    """LocalWorkerGroup sets the SPMD variables in this process; monkeypatch restores them after."""
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)


@pytest.fixture
def local(spmd_env_restored):
    return LocalWorkerGroup(ray_cls_with_init=RayClassWithInitArgs(ProbeWorker, "local"))


def test_local_group_sets_a_world_of_one(local):
    (env,) = local.env()
    seen = (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["MASTER_ADDR"])
    assert seen == ("0", "1", "0", "127.0.0.1")
    assert env["tag"] == "local" and local.worker.rank == 0


def test_local_group_runs_every_dispatch_mode(local):
    data = DataProto.from_dict({"x": torch.arange(3)})
    assert local.echo("v") == [(0, "v", None)]
    assert local.per_rank(["only"]) == [(0, "only")]
    assert local.on_rank_zero(5) == (0, 5)
    assert local.dp_compute([7]) == [(0, 7)]
    assert local.double(data).batch["x"].tolist() == [0, 2, 4]
    assert local.apply(torch.neg, data).batch["x"].tolist() == [0, -1, -2]
    assert local.metric(data) == [{"rank": 0, "rows": 3, "sum": 3}]
    assert local.custom(1) == 1
    local.register_megatron_ranks(1, 1, 1)
    assert local.megatron(["dp0"]) == [(0, "dp0")]
    assert local.times_ten(data).batch["x"].tolist() == [0, 10, 20]
    assert local.pp_as_dp(data).batch["rank"].tolist() == [0, 0, 0]
    later = local.plus_one_later(data)  # non-blocking: the value itself, accepted by the next call
    assert local.times_ten(later).batch["x"].tolist() == [10, 20, 30]


def test_local_group_lets_worker_exceptions_through_unchanged(local):
    with pytest.raises(ValueError, match="broken") as info:
        local.fail_on(0, "broken")
    assert type(info.value) is ValueError
    assert "raised on rank 0 in `fail_on`" in "\n".join(info.value.__notes__)


def test_megatron_dispatch_needs_registered_parallel_ranks(local):
    with pytest.raises(RuntimeError, match=r"ranks \[0\] have not called self.set_parallel_ranks"):
        local.times_ten(DataProto.from_dict({"x": torch.arange(2)}))


def test_local_misuse_is_reported(local):
    with pytest.raises(UnregisteredMethodError, match="not decorated with @register"):
        local.not_registered()
    with pytest.raises(ValueError, match="ALL_TO_ALL expects every argument to be a list"):
        local.per_rank("not a list")
    padded = DataProto.from_dict({"x": torch.arange(3)}, meta_info={DataProtoConfig.auto_padding_key: True})
    assert local.double(padded).batch["x"].tolist() == [0, 2, 4]
    with pytest.raises(ValueError, match="world size 2"):
        LocalWorkerGroup(RayResourcePool([2]), RayClassWithInitArgs(ProbeWorker, "x"))


def test_local_colocated_roles_share_the_driver_process(spmd_env_restored):
    actor, critic = RayClassWithInitArgs(ActorRole, "a"), RayClassWithInitArgs(CriticRole, "c")
    fused = create_colocated_worker_cls({"actor_rollout": actor, "critic": critic})
    views = LocalWorkerGroup(ray_cls_with_init=fused).spawn(prefix_set=["actor_rollout", "critic"])
    assert views["critic"].whoami()[0][0] == "c" and views["actor_rollout"].whoami()[0][0] == "a"
    views["critic"].setup(1)
    data = DataProto.from_dict({"x": torch.tensor([4])})
    assert views["critic"].compute_values(data).batch["values"].tolist() == [2.0]
    with pytest.raises(RuntimeError, match=r"have not called self\.set_parallel_ranks"):
        views["actor_rollout"].generate_sequences(data)  # each role registers its own ranks


def test_register_rejects_bad_modes():
    with pytest.raises(ValueError, match="exactly the keys 'dispatch_fn' and 'collect_fn'"):
        register(dispatch_mode={"dispatch_fn": print})
    with pytest.raises(TypeError, match="Dispatch member"):
        register(dispatch_mode="ONE_TO_ALL")
    with pytest.raises(ValueError, match="RANK_ZERO runs on rank 0 only"):
        register(dispatch_mode=Dispatch.RANK_ZERO, execute_mode=Execute.ALL)


def test_worker_outside_a_group_says_how_to_build_it(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(RuntimeError, match=r"RANK is not set.*RayWorkerGroup or LocalWorkerGroup"):
        _ = Worker().rank


def test_local_shutdown_runs_the_worker_teardown_and_reports_its_failure(spmd_env_restored, tmp_path, capsys):
    group = LocalWorkerGroup(ray_cls_with_init=RayClassWithInitArgs(TeardownRole, "actor", str(tmp_path)))
    group.shutdown()
    assert (tmp_path / "actor-rank0").exists()
    failing = LocalWorkerGroup(
        ray_cls_with_init=RayClassWithInitArgs(TeardownRole, "actor", str(tmp_path), True)
    )
    failing.shutdown()  # reported, not raised
    assert "could not stop its engine" in capsys.readouterr().err
