"""PoolRollout.recover over worker groups that stand in for Ray's (the real engine's restart runs in
test_engine_restarts.py): a generation, a launched generation or a transfer that meets a dead
rollout process restarts it in its slot, rebuilds the transfer group (the sender leaves first),
sends the policy last synced, checks the fresh engine's log-probs of fixed tokens, and generates
the lost rows again with the lost call's seed; one death beyond rollout.max_engine_restarts, or
any with 0, is one RolloutProcessDied naming the process and the call."""

import json
from pathlib import Path

import pytest
import ray.exceptions
import torch

from engines.rollout.config import RolloutConfig
from engines.weight_sync.common import WeightSyncError
from hybridflow.protocol import DataProto
from hybridflow.single_controller.errors import worker_error
from hybridflow.trainer.policy import Policy
from hybridflow.trainer.rollout.pool import RESTARTS_FILE, PoolRollout, RolloutProcessDied

PROBE = [[1, 2, 3, 4], [5, 6, 7, 8]]
ACTOR_LOG_PROBS = torch.tensor([[-1.0, -2.0], [-0.5, -0.25]])  # (B, R): the probe's last 2 tokens


class PolicyGroup:
    def __init__(self, calls: list):
        self.calls = calls

    def send_weights(self, version: int) -> None:
        self.calls.append(("send", version))

    def leave_transfer(self) -> None:
        self.calls.append(("sender leaves",))

    def transfer_address(self) -> tuple[str, int]:
        return "127.0.0.1", 1

    def join_transfer(self, host: str, port: int, size: int) -> None:
        self.calls.append(("sender joins",))

    def probe_log_probs(self) -> list:
        return [None, (PROBE, ACTOR_LOG_PROBS)]  # the last pipeline stage answers


class RolloutGroup:
    """One rollout process that dies at the generation calls numbered in `deaths` (1-based, counted
    over the run), until restarted; the engines serve the version last sent."""

    world_size = 1

    def __init__(self, calls: list, deaths: set[int], engine_error: float = 0.0):
        self.calls, self.deaths, self.engine_error = calls, deaths, engine_error
        self.save_deaths: set[int] = set()  # the save calls (1-based) the process dies in
        self.generated = self.saved = 0
        self.dead = False
        self.seeds: list[int] = []

    def died(self, method: str):
        self.dead = True
        return worker_error(ray.exceptions.ActorDiedError(), 0, method)

    def generate_sequences(self, rows: DataProto) -> DataProto:
        self.generated += 1
        if self.dead or self.generated in self.deaths:
            raise self.died("generate_sequences")
        self.seeds.append(rows.meta_info["seed"])
        return DataProto.from_dict({"responses": rows.batch["input_ids"] + 100}, meta_info=rows.meta_info)

    def generate_sequences_async(self, rows: DataProto):
        return None  # a future the test replaces

    def dead_ranks(self) -> list[int]:
        return [0] if self.dead else []

    def ping(self) -> None:
        if self.dead:
            raise self.died("ping")

    def advance_rng_state(self, position: dict) -> None:
        if self.dead:
            raise self.died("advance_rng_state")

    def save_rng_state(self, path: str) -> None:
        self.saved += 1
        if self.dead or self.saved in self.save_deaths:
            raise self.died("save_rng_state")
        (Path(path) / "rng_state_0.json").write_text("{}")

    def restart_rank(self, rank: int) -> None:
        self.dead = False
        self.calls.append(("restart", rank))

    def call_rank(self, rank: int, method: str, *args):
        self.calls.append((method, rank))
        if method == "score_log_probs":
            return torch.tensor([[-9.0, -1.0, -2.0], [-9.0, -0.5, -0.25]]) + self.engine_error
        return None

    def leave_transfer(self) -> None:
        self.calls.append(("receivers leave",))

    def start_join_transfer(self, host: str, port: int, size: int) -> None:
        pass

    def start_receive_weights(self) -> None:
        if self.dead:
            raise self.died("start_receive_weights")

    def finish_transfer(self) -> list:
        return [self.sent_version()]

    def sent_version(self):
        sends = [call[1] for call in self.calls if call[0] == "send"]
        return sends[-1] if sends else None


def pool_over(tmp_path, deaths: set[int], max_engine_restarts: int, engine_error: float = 0.0):
    calls: list = []
    rollout_group = RolloutGroup(calls, deaths, engine_error)
    policy = Policy(PolicyGroup(calls))
    pool = PoolRollout(rollout_group, str(tmp_path), RolloutConfig(max_engine_restarts=max_engine_restarts))
    pool.sync_weights(policy)
    return pool, policy, rollout_group, calls


def rows(first: int) -> DataProto:
    return DataProto.from_dict({"input_ids": torch.arange(first, first + 4).reshape(2, 2)})


def test_a_generation_that_meets_a_dead_process_is_generated_again_after_a_checked_restart(tmp_path):
    pool, policy, group, calls = pool_over(tmp_path, deaths={2}, max_engine_restarts=1)
    pool.generate(rows(0))
    policy.version = 1
    pool.sync_weights(policy)
    calls.clear()
    out = pool.generate(rows(10))  # dies, is restarted, generated again
    assert torch.equal(out.batch["responses"], rows(10).batch["input_ids"] + 100)
    assert group.seeds == [42, 43]  # the second call's seed both times (the lost attempt had 43)
    assert "seed" not in out.meta_info
    assert calls == [
        ("restart", 0),
        ("init_model", 0),
        ("sender leaves",),  # first: its connections close, so a survivor's receive fails
        ("receivers leave",),
        ("sender joins",),
        ("send", 1),  # the policy last synced
        ("score_log_probs", 0),
    ]
    metrics = pool.metrics(DataProto.from_dict({"policy_version": torch.tensor([1, 1])}))
    assert metrics["rollout/engine_restarts"] == 1.0 and metrics["rollout/restart_seconds"] > 0
    assert metrics["rollout/restart_log_prob_diff"] == 0.0
    later = pool.metrics(DataProto.from_dict({"policy_version": torch.tensor([1, 1])}))
    assert later["rollout/restart_seconds"] == 0.0 and "rollout/restart_log_prob_diff" not in later


def test_a_launched_generation_whose_process_died_is_collected_from_its_rows(tmp_path):
    pool, _, group, _ = pool_over(tmp_path, deaths=set(), max_engine_restarts=1)
    group.dead = True  # the launched call's future fails as Ray's own error
    lost = pool.launch(rows(0))

    class DeadFuture:
        def get(self):
            raise ray.exceptions.ActorDiedError()

    lost.future = DeadFuture()
    out = pool.collect(lost)
    assert torch.equal(out.batch["responses"], rows(0).batch["input_ids"] + 100)
    assert group.seeds == [42]


def test_a_save_that_meets_a_dead_process_saves_again_after_a_checked_restart(tmp_path):
    pool, _, group, calls = pool_over(tmp_path / "run", deaths=set(), max_engine_restarts=1)
    group.save_deaths = {1}
    calls.clear()
    saved = tmp_path / "checkpoint"
    saved.mkdir()
    pool.save(str(saved))
    assert calls[:2] == [("restart", 0), ("init_model", 0)] and ("send", 0) in calls
    assert (saved / "rng_state_0.json").is_file()  # the restarted process's state, saved again
    assert json.loads((saved / RESTARTS_FILE).read_text()) == {"count": 1}  # the save's restart too


def test_a_save_that_meets_a_death_beyond_the_limit_is_one_named_error(tmp_path):
    pool, _, group, _ = pool_over(tmp_path, deaths=set(), max_engine_restarts=0)
    group.save_deaths = {1}
    with pytest.raises(RolloutProcessDied, match=r"^rollout pool process 0 died during `save_rng_state`"):
        pool.save(str(tmp_path))


def test_one_death_beyond_the_limit_is_one_named_error(tmp_path):
    pool, _, _, _ = pool_over(tmp_path, deaths={1, 2}, max_engine_restarts=1)
    with pytest.raises(RolloutProcessDied) as raised:
        pool.generate(rows(0))
    assert str(raised.value).startswith("rollout pool process 0 died during `generate_sequences` (")
    assert "1 restart(s) before, rollout.max_engine_restarts=1; rerun the same command" in str(raised.value)


def test_with_no_restarts_allowed_the_first_death_ends_the_run_as_before(tmp_path):
    pool, _, group, calls = pool_over(tmp_path, deaths=set(), max_engine_restarts=0)
    group.dead = True
    with pytest.raises(RolloutProcessDied) as raised:
        pool.sync_weights(Policy(PolicyGroup(calls)))  # version 0 is served: no transfer, nothing met
        pool.generate(rows(0))
    assert str(raised.value).startswith("rollout pool process 0 died during `generate_sequences`")
    assert "max_engine_restarts" not in str(raised.value)
    assert ("restart", 0) not in calls


def test_a_restarted_engine_unlike_the_actor_stops_the_run(tmp_path):
    pool, _, _, _ = pool_over(tmp_path, deaths={1}, max_engine_restarts=1, engine_error=0.01)
    with pytest.raises(WeightSyncError, match=r"differ from the actor's \(policy version 0\) by up to 0.01"):
        pool.generate(rows(0))


def test_validation_calls_take_seeds_apart_from_the_training_calls(tmp_path):
    """The pool seeds calls as the engines would (SamplingPosition): a validation call between two
    training calls leaves the second training call its seed."""
    pool, _, group, _ = pool_over(tmp_path, deaths=set(), max_engine_restarts=0)
    pool.generate(rows(0))
    validation = rows(0)
    validation.meta_info["validate"] = True
    pool.generate(validation)
    pool.generate(rows(10))
    assert group.seeds[0::2] == [42, 43]  # the training calls: rollout.seed + k
    assert group.seeds[1] not in (42, 43, 44)
    assert pool.position.state() == {"calls": 2, "val_calls": 1}


def test_a_send_that_fails_with_no_process_dead_names_every_members_error(tmp_path):
    """A receiver that fails its receive (a buffer it could not allocate) closes its end, and the
    sender's error is the echo of that: the run stops with one WeightSyncError naming both, and a
    receiver still receiving at the transfer deadline, nothing restarted. The receivers are asked at
    once, under one deadline (not one each)."""
    pool, policy, group, _ = pool_over(tmp_path, deaths=set(), max_engine_restarts=1)
    echo = raised_on_worker("send_weights", RuntimeError("Connection closed by peer"))
    cause = raised_on_worker("finish_transfer", MemoryError("could not allocate a 2.0 GiB receive buffer"))
    waits = []

    def send_weights(version: int) -> None:
        raise echo

    def wait_calls(calls: list, count=None, wait_s=None) -> list:
        waits.append((calls, count, wait_s))
        return [call for call in calls if call != (1, "finish_transfer")]  # rank 1 still receiving

    def call_result(call, rank: int, method: str):
        raise cause

    policy.group.send_weights, group.world_size = send_weights, 2
    group.call_rank_async = lambda rank, method: (rank, method)
    group.wait_calls, group.call_result = wait_calls, call_result
    policy.version = 1
    with pytest.raises(WeightSyncError) as raised:
        pool.sync_weights(policy)
    assert str(raised.value) == (
        "weight transfer to the rollout pool failed: `send_weights` raised on rank 0: RuntimeError: "
        "Connection closed by peer; `finish_transfer` raised on rank 0: MemoryError: could not allocate "
        "a 2.0 GiB receive buffer; rollout pool process rank 1 did not answer `finish_transfer` within "
        "600s (rollout.weight_transfer_timeout_s: raise it if the call is only slow)"
    )
    assert waits == [([(0, "finish_transfer"), (1, "finish_transfer")], None, 600.0)]
    assert raised.value.__cause__ is echo
    assert pool.restarts.count == 0  # nothing died: nothing restarted


def raised_on_worker(method: str, err: Exception):
    """The driver's error for `err` raised inside `method` on rank 0's worker, as Ray reports it."""
    return worker_error(
        ray.exceptions.RayTaskError(method, "Traceback (most recent call last): ...", err), 0, method
    )
