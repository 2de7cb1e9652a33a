"""Hung workers and engines (Ray actors of tests/async_rl/hung_workers.py, whose calls can block
forever) never block the driver past their deadline:

- a worker-group call on a rank that never answers raises, at the group's deadline, one error
  naming the worker class, the rank, the call and the recipe setting to raise;
- in stream mode a group call still running at rollout.engine_call_timeout_s gets its engine
  health-checked: a busy engine (it answers between two steps) keeps its call, which finishes; a
  hung one (its step never returns) is killed and, with a restart left, restarted by the pool with
  its group generated again; with none left the run's error is one line naming the process, the
  call it hung in and the setting, and the hung process is gone;
- a hung generation through the pool's group call, or launched ahead (the modes without
  streaming), is restarted the same way once its call's deadline passes;
- a weight transfer whose receiver never finishes ends at rollout.weight_transfer_timeout_s.

The settings are seconds; each test's own bound is far longer (BOUND_S).
"""

import time
import uuid

import psutil
import pytest
import torch
from hung_workers import HANG, HangingWorker, SteppingRollout
from run_processes import wait_for

from engines.rollout.config import RolloutConfig
from hybridflow.protocol import DataProto
from hybridflow.single_controller import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
from hybridflow.single_controller.errors import CallDeadline, CallTimeout
from hybridflow.trainer.policy import Policy
from hybridflow.trainer.rollout.pool import PoolRollout, RolloutProcessDied
from hybridflow.trainer.rollout.stream import (
    EngineDeadlines,
    Group,
    RayGroupCalls,
    StreamingRollout,
    StreamSettings,
)

CALL_S = 3.0  # the deadline settings under test
BOUND_S = 90.0  # what each test allows, Ray's actor starts and restarts included
SETTINGS = StreamSettings(n=1, groups_per_step=2, max_staleness=0, stale_groups="drop", pad_token_id=0)

pytestmark = pytest.mark.timeout(240)


class PolicyGroup:
    """The actor's side of the transfers, as no-ops (the engines stand-ins serve version 0)."""

    def send_weights(self, version: int) -> None:
        pass

    def leave_transfer(self) -> None:
        pass

    def transfer_address(self) -> tuple[str, int]:
        return "127.0.0.1", 1

    def join_transfer(self, host: str, port: int, size: int) -> None:
        pass

    def probe_log_probs(self) -> list:
        return [([[1, 2, 3]], torch.zeros(1, 2))]


@pytest.fixture
def groups(ray_cluster):
    """Builds worker groups (stopped, their placement released, when the test ends)."""
    made = []

    def build(processes: int, cls_with_init: RayClassWithInitArgs, deadline: CallDeadline) -> RayWorkerGroup:
        pool = RayResourcePool([processes], name_prefix=f"hung_{uuid.uuid4().hex[:8]}")
        made.append((pool, RayWorkerGroup(pool, cls_with_init, deadline)))
        return made[-1][1]

    yield build
    for pool, group in made:
        group.shutdown()
        pool.release()


def rollout_group(groups, folder, processes: int, call_s: float = 600.0) -> RayWorkerGroup:
    cls_with_init = RayClassWithInitArgs(SteppingRollout, str(folder)).with_actor_options(max_concurrency=4)
    return groups(processes, cls_with_init, CallDeadline(call_s, "trainer.worker_call_timeout_s"))


def stream_of(group, restarts: int, folder) -> StreamingRollout:
    pool = PoolRollout(group, str(folder), RolloutConfig(max_engine_restarts=restarts))
    pool.sync_weights(Policy(PolicyGroup()))
    deadlines = EngineDeadlines(check_after_s=CALL_S, check_s=CALL_S, bound_s=BOUND_S)
    return StreamingRollout(pool, RayGroupCalls(group, deadlines), SETTINGS)


def group_of(index: int, **how) -> Group:
    rows = DataProto.from_dict({"x": torch.tensor([index])}, meta_info=how)
    return Group(rows, rows, rows)


def test_a_worker_call_that_never_returns_raises_at_its_deadline_naming_the_rank(groups):
    group = groups(
        2, RayClassWithInitArgs(HangingWorker), CallDeadline(CALL_S, "trainer.worker_call_timeout_s")
    )
    start = time.monotonic()
    with pytest.raises(CallTimeout) as err:
        group.hang_on(1)
    assert time.monotonic() - start < BOUND_S
    assert str(err.value) == (
        "HangingWorker rank 1 did not answer `hang_on` within 3s "
        "(trainer.worker_call_timeout_s: raise it if the call is only slow)"
    )


def test_a_busy_engine_answers_its_health_check_and_its_call_finishes(groups, tmp_path):
    group = rollout_group(groups, tmp_path, 1)
    stream = stream_of(group, 0, tmp_path)
    stream.submit(group_of(7, steps=int(3 * CALL_S / 0.05)))  # about 3 x engine_call_timeout_s
    finished = stream.next_finished()
    assert int(finished.responses.batch["x"][0]) == 7
    assert group.dead_ranks() == [] and stream.pool.restarts.count == 0


def test_in_stream_mode_a_hung_engine_is_restarted_and_its_group_generated_again(groups, tmp_path):
    group = rollout_group(groups, tmp_path, 2)
    hung_pid = group.pid()[0]
    stream = stream_of(group, 1, tmp_path)
    stream.submit(group_of(0, hang_once=True))  # rank 0, the fewest calls in flight
    stream.submit(group_of(1))  # rank 1
    start = time.monotonic()
    finished = sorted(int(stream.next_finished().responses.batch["x"][0]) for _ in range(2))
    assert time.monotonic() - start < BOUND_S
    assert finished == [0, 1]
    assert stream.pool.restarts.count == 1
    assert (tmp_path / "hung").exists()  # it did hang, on the first process
    assert not psutil.pid_exists(hung_pid) or psutil.Process(hung_pid).status() == psutil.STATUS_ZOMBIE


def test_in_stream_mode_a_hung_engine_without_restarts_left_ends_with_one_named_error(groups, tmp_path):
    group = rollout_group(groups, tmp_path, 1)
    hung_pid = group.pid()[0]
    stream = stream_of(group, 0, tmp_path)
    stream.submit(group_of(0, steps=HANG))
    start = time.monotonic()
    with pytest.raises(RolloutProcessDied) as err:
        stream.next_finished()
    assert time.monotonic() - start < BOUND_S
    assert str(err.value) == (
        "rollout pool process 0 hung in `generate_sequences` (trainer.rollout_pool): CallTimeout: "
        "rollout engine rank 0 did not answer `generate_sequences` within 3s nor its health check "
        "within 3s (rollout.engine_call_timeout_s: raise it if the call is only slow); rerun the same "
        "command to resume from the last checkpoint"
    )
    wait_for(lambda: not psutil.pid_exists(hung_pid), 60, "the hung rollout process to exit")


def test_a_hung_generation_through_the_pool_is_restarted_and_generated_again(groups, tmp_path):
    group = rollout_group(groups, tmp_path, 1, call_s=CALL_S)
    pool = PoolRollout(group, str(tmp_path), RolloutConfig(max_engine_restarts=1))
    pool.sync_weights(Policy(PolicyGroup()))
    start = time.monotonic()
    out = pool.generate(group_of(5, hang_once=True).rows)
    assert time.monotonic() - start < BOUND_S
    assert out.batch["x"].tolist() == [5] and pool.restarts.count == 1


def test_a_weight_transfer_that_never_finishes_ends_at_its_deadline_naming_the_process(groups, tmp_path):
    group = rollout_group(groups, tmp_path, 1)
    pool = PoolRollout(
        group, str(tmp_path), RolloutConfig(max_engine_restarts=0, weight_transfer_timeout_s=CALL_S)
    )
    (tmp_path / "hang_transfer").touch()
    start = time.monotonic()
    with pytest.raises(RolloutProcessDied) as err:
        pool.sync_weights(Policy(PolicyGroup()))
    assert time.monotonic() - start < BOUND_S
    assert str(err.value) == (
        "rollout pool process 0 hung in `finish_transfer` (trainer.rollout_pool): CallTimeout: "
        "SteppingRollout rank 0 did not answer `finish_transfer` within 3s "
        "(rollout.weight_transfer_timeout_s: raise it if the call is only slow); rerun the same "
        "command to resume from the last checkpoint"
    )


def test_a_hung_generation_launched_ahead_is_restarted_and_generated_again(groups, tmp_path):
    group = rollout_group(groups, tmp_path, 1, call_s=CALL_S)
    pool = PoolRollout(group, str(tmp_path), RolloutConfig(max_engine_restarts=1))
    pool.sync_weights(Policy(PolicyGroup()))
    start = time.monotonic()
    out = pool.collect(pool.launch(group_of(6, hang_once=True).rows))
    assert time.monotonic() - start < BOUND_S
    assert out.batch["x"].tolist() == [6] and pool.restarts.count == 1
