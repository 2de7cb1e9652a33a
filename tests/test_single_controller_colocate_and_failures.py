"""Colocated roles in one process per slot, dead workers, teardown at shutdown, and pools the
cluster cannot place.

Uses the session Ray cluster (16 logical CPUs, one node): at most 2 actors alive at a time.
"""

import time

import pytest
import ray
import torch
from single_controller_workers import ActorRole, CriticRole, GateWorker, ProbeWorker, TeardownRole

from hybridflow.protocol import DataProto
from hybridflow.single_controller import (
    Dispatch,
    RayClassWithInitArgs,
    RayResourcePool,
    RayWorkerGroup,
    ResourcePoolManager,
    Role,
    WorkerError,
    create_colocated_worker_cls,
    register,
)


@pytest.fixture
def pool_of_two(ray_cluster):
    pool = RayResourcePool([2], name_prefix="test_colocate")
    yield pool
    pool.release()


def test_colocated_roles_share_one_process_per_slot_and_route_by_prefix(pool_of_two):
    fused = create_colocated_worker_cls(
        {
            "actor_rollout": RayClassWithInitArgs(ActorRole, "actor"),
            "critic": RayClassWithInitArgs(CriticRole, "critic"),
        }
    )
    group = RayWorkerGroup(pool_of_two, fused)
    try:
        # The fused group exposes role-prefixed methods; views drop the prefix.
        assert [name for name, _, _ in group.critic_whoami()] == ["critic", "critic"]
        views = group.spawn(prefix_set={"actor_rollout", "critic"})
        actor, critic = views["actor_rollout"], views["critic"]
        actor_who, critic_who = actor.whoami(), critic.whoami()
        assert [(name, rank) for name, rank, _ in actor_who] == [("actor", 0), ("actor", 1)]
        assert [(name, rank) for name, rank, _ in critic_who] == [("critic", 0), ("critic", 1)]
        assert [pid for *_, pid in actor_who] == [pid for *_, pid in critic_who]  # same process per slot
        assert len({pid for *_, pid in actor_who}) == 2
        assert not hasattr(critic, "generate_sequences") and not hasattr(actor, "compute_values")

        actor.setup(2)
        critic.setup(2)
        data = DataProto.from_dict({"x": torch.arange(4)})
        assert actor.generate_sequences(data).batch["responses"].tolist() == [1000, 1001, 1002, 1003]
        assert critic.compute_values(data).batch["values"].tolist() == [0.0, 0.5, 1.0, 1.5]
    finally:
        group.shutdown()


class RoleWithXSetup(ActorRole):
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def x_setup(self):
        return 0


def test_colocated_method_names_must_not_collide():
    # Role "a" method "x_setup" and role "a_x" method "setup" would both be "a_x_setup".
    with pytest.raises(ValueError, match="'a_x_setup' is produced by both role 'a' and role 'a_x'"):
        create_colocated_worker_cls(
            {"a": RayClassWithInitArgs(RoleWithXSetup, "x"), "a_x": RayClassWithInitArgs(ActorRole, "y")}
        )


def test_a_colocated_role_cannot_ask_for_actor_options_of_its_own():
    rollout = RayClassWithInitArgs(ActorRole, "x").with_actor_options(max_concurrency=4)
    with pytest.raises(ValueError, match=r"class_dict\['rollout'\] asks for Ray actor options"):
        create_colocated_worker_cls({"rollout": rollout, "critic": RayClassWithInitArgs(CriticRole, "y")})


def test_actor_options_reach_ray_so_a_call_runs_beside_another(ray_cluster):
    pool = RayResourcePool([1], name_prefix="test_actor_options")
    group = RayWorkerGroup(pool, RayClassWithInitArgs(GateWorker).with_actor_options(max_concurrency=2))
    try:
        waiting = group.call_rank_async(0, "wait_for_gate", 120.0)  # a bound for a failure, not a timing
        group.open_gate()
        assert group.wait_calls([waiting]) == [waiting]
        opened = group.call_result(waiting, 0, "wait_for_gate")
        assert opened, "the gate opened after the waiting call gave up: calls ran one at a time"
    finally:
        group.shutdown()
        pool.release()


@pytest.mark.timeout(180)
def test_dead_worker_is_reported_with_rank_and_method_without_hanging(pool_of_two):
    group = RayWorkerGroup(pool_of_two, RayClassWithInitArgs(ProbeWorker, "doomed"))
    try:
        start = time.monotonic()
        # Rank 1 exits; rank 0 would stay busy for 120 s (a collective waiting on its dead peer).
        with pytest.raises(ray.exceptions.ActorDiedError) as info:
            group.exit_on(1, others_sleep_s=120)
        assert time.monotonic() - start < 60
        assert isinstance(info.value, WorkerError) and info.value.rank == 1
        assert "rank 1" in str(info.value) and "exit_on" in str(info.value)

        busy = group.call_rank_async(0, "echo", "queued behind exit_on")
        group.kill_rank(0)  # the busy rank: its calls in flight fail as a dead process's do
        assert group.dead_ranks() == [0, 1]  # killed is dead at once, not busy (alive) for a while
        with pytest.raises(ray.exceptions.RayActorError, match=r"`echo` failed on rank 0") as info:
            group.call_result(group.wait_calls([busy])[0], 0, "echo")
        assert isinstance(info.value, WorkerError) and info.value.rank == 0
        with pytest.raises(ray.exceptions.RayActorError, match=r"`on_rank_zero` failed on rank 0"):
            group.on_rank_zero("anyone there?")
        with pytest.raises(ValueError, match=r"ProbeWorker.not_registered is not a @register-ed method"):
            group.call_rank_async(1, "not_registered")
    finally:
        group.shutdown()


def test_shutdown_tears_down_every_rank_and_role_before_killing(pool_of_two, tmp_path):
    roles = {
        role: RayClassWithInitArgs(TeardownRole, role, str(tmp_path)) for role in ("actor_rollout", "critic")
    }
    group = RayWorkerGroup(pool_of_two, create_colocated_worker_cls(roles))
    pids = [pid for *_, pid in group.actor_rollout_whoami()]
    group.shutdown()
    markers = {path.name: path.read_text() for path in tmp_path.iterdir()}
    assert markers == {
        f"{role}-rank{rank}": str(pid) for role in roles for rank, pid in enumerate(pids)
    }  # run in the workers' own processes, before they were killed


def test_shutdown_kills_a_rank_too_busy_to_tear_down_and_reports_failures(pool_of_two, tmp_path, capsys):
    group = RayWorkerGroup(pool_of_two, RayClassWithInitArgs(TeardownRole, "actor", str(tmp_path)))
    group.busy_on(1)  # non-blocking; rank 1 never returns
    group.shutdown(teardown_timeout_s=5)
    assert not (tmp_path / "actor-rank1").exists()
    assert "rank 1: TeardownRole.teardown did not finish within 5s" in capsys.readouterr().err
    with pytest.raises(ray.exceptions.RayActorError):  # rank 1 never answers unless killed
        group.whoami()

    failing = RayWorkerGroup(pool_of_two, RayClassWithInitArgs(TeardownRole, "actor", str(tmp_path), True))
    failing.shutdown()  # reported, not raised: shutdown runs while another error may propagate
    assert "could not stop its engine" in capsys.readouterr().err


def test_shutdown_says_nothing_of_a_rank_whose_process_is_gone(pool_of_two, tmp_path, capsys):
    group = RayWorkerGroup(pool_of_two, RayClassWithInitArgs(TeardownRole, "actor", str(tmp_path)))
    ray.kill(group.actors[1], no_restart=True)  # as a crash would: its death is reported elsewhere
    _wait_until_gone(group.actors[1])
    group.shutdown()
    assert (tmp_path / "actor-rank0").exists() and not (tmp_path / "actor-rank1").exists()
    assert "rank 1" not in capsys.readouterr().err


def test_pool_larger_than_cluster_fails_before_creating_anything(ray_cluster):
    before = len(ray.util.placement_group_table())
    with pytest.raises(ValueError, match=r"needs 1 distinct nodes hosting \[64\] slots"):
        RayWorkerGroup(RayResourcePool([64], name_prefix="too_big"), RayClassWithInitArgs(ProbeWorker, "x"))
    with pytest.raises(ValueError, match=r"needs 2 distinct nodes"):  # the session cluster has one node
        RayResourcePool([1, 1], name_prefix="two_nodes").placement_groups()
    assert len(ray.util.placement_group_table()) == before


@pytest.mark.timeout(120)
def test_pool_waits_a_bounded_time_when_resources_are_held(ray_cluster):
    held = RayResourcePool([int(ray.cluster_resources()["CPU"]) - 1], name_prefix="holder")
    held.placement_groups()
    try:
        start = time.monotonic()
        with pytest.raises(TimeoutError, match="was not placed within 2s"):
            RayResourcePool([2], name_prefix="starved", placement_timeout_s=2).placement_groups()
        assert time.monotonic() - start < 30
    finally:
        held.release()


def test_resource_pool_manager_maps_roles_and_names_missing_resources(ray_cluster):
    manager = ResourcePoolManager(
        resource_pool_spec={"global_pool": [2], "rm_pool": [1]},
        mapping={Role.ActorRollout: "global_pool", Role.Critic: "global_pool", Role.RewardModel: "rm_pool"},
    )
    manager.check_resources_available()
    manager.create_resource_pool()
    assert manager.get_resource_pool(Role.Critic) is manager.get_resource_pool(Role.ActorRollout)
    assert manager.get_resource_pool(Role.RewardModel).world_size == 1
    assert manager.get_n_procs() == 3
    with pytest.raises(KeyError, match="RefPolicy"):
        manager.get_resource_pool(Role.RefPolicy)

    cpus = int(ray.cluster_resources()["CPU"])
    too_big = ResourcePoolManager(resource_pool_spec={"a": [cpus], "b": [1]}, mapping={Role.Critic: "a"})
    with pytest.raises(ValueError, match=rf"need {cpus + 1} CPU in all .* the cluster has {cpus} CPU"):
        too_big.check_resources_available()
    with pytest.raises(ValueError, match="not in resource_pool_spec"):
        ResourcePoolManager(resource_pool_spec={"a": [1]}, mapping={Role.Critic: "missing"})


def _wait_until_gone(actor, limit_s=300):
    """ray.kill is asynchronous: calls queued before the kill lands are still answered."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        try:
            ray.get(actor.__ray_ready__.remote())
        except ray.exceptions.RayActorError:
            return
        time.sleep(0.1)
    pytest.fail(f"the killed actor still answered after {limit_s} s")
