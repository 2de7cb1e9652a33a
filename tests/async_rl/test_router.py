"""The rollout router (hybridflow/trainer/rollout/router.py) and the routed agent rollout's sessions
(routed.py) over replicas that stand in for the pool's processes (the real run, with vLLM replicas
and a killed one: test_routed_agent_run.py): a session's turns stay on one replica while it lives,
new sessions go to the least-loaded replica by outstanding tokens, a lost replica's sessions move
and their lost turn is asked again, from the same ids and seed."""

import asyncio
import json
import threading
from concurrent.futures import Future

import pytest
import ray.exceptions

from engines.rollout.config import SamplingConfig
from engines.rollout.requests import Completion
from hybridflow.single_controller.errors import CallDeadline, WorkerError
from hybridflow.trainer.rollout.routed import RoutedAgentRollout, Session
from hybridflow.trainer.rollout.router import Router


def test_new_sessions_go_to_the_least_loaded_replica_and_turns_stay_with_their_session():
    router = Router(3)
    sessions = [("a", 100), ("b", 10), ("c", 50), ("d", 5)]
    assert [router.route(session, 0, tokens) for session, tokens in sessions] == [0, 1, 2, 1]
    # outstanding: 0 -> 100, 1 -> 15, 2 -> 50; "a" stays on 0, the most loaded
    assert router.route("a", 1, 100) == 0
    router.finished(0, 100)
    router.finished(0, 100)
    assert router.route("e", 0, 1) == 0  # 0 is the least loaded now (0 < 15 < 50)
    assert [r["replica"] for r in router.take_routes()] == [0, 1, 2, 1, 0, 0]
    assert router.take_routes() == []


def test_ties_go_to_the_lowest_rank():
    router = Router(2)
    assert [router.route(s, 0, 7) for s in "abcd"] == [0, 1, 0, 1]


def test_a_lost_replicas_sessions_move_and_a_restored_one_takes_new_sessions():
    router = Router(2)
    router.route("a", 0, 10)  # -> 0
    router.route("b", 0, 10)  # -> 1
    router.lost(1)
    assert router.route("b", 1, 10) == 0 and router.route("c", 0, 1) == 0
    router.restored([1])
    assert router.route("a", 1, 10) == 0  # a session stays where it is
    assert router.route("d", 0, 1) == 1  # 0 holds 31 outstanding tokens, 1 holds b's first 10
    routes = router.take_routes()
    assert [(r["session"], r["turn"], r["replica"], r["moved"]) for r in routes] == [
        ("a", 0, 0, False), ("b", 0, 1, False), ("b", 1, 0, True), ("c", 0, 0, False),
        ("a", 1, 0, False), ("d", 0, 1, False),
    ]  # fmt: skip


def test_no_live_replica_is_an_error_naming_it():
    router = Router(1)
    router.lost(0)
    with pytest.raises(RuntimeError, match="every rollout replica died"):
        router.route("a", 0, 1)


class Replicas:
    """Rollout processes that answer each request at once; the calls numbered in `deaths` (1-based,
    over all replicas) meet their replica dead, as does every later call to a dead replica."""

    def __init__(self, world_size: int, deaths: set[int], failures: set[int] = frozenset()):
        self.world_size, self.deaths, self.failures = world_size, deaths, failures  # failures: engine errors
        self.dead: set[int] = set()
        self.calls: list[tuple[int, list[int], int]] = []  # (replica, ids, seed)

    def call_rank_async(self, rank: int, method: str, ids, sampling, seed, max_new_tokens):
        assert method == "generate_request"
        self.calls.append((rank, list(ids), seed))
        if len(self.calls) in self.deaths:
            self.dead.add(rank)
        answer = Future()
        if rank in self.dead:
            answer.set_exception(ray.exceptions.RayActorError())
        elif len(self.calls) in self.failures:
            error = ValueError("the engine refused the request")
            answer.set_exception(ray.exceptions.RayTaskError("generate_request", "traceback", error))
        else:
            answer.set_result(Completion([len(ids)], [-1.0], [0], "stop", len(ids), 0))
        return Call(answer)


class Call:
    def __init__(self, answer: Future):
        self.answer = answer

    def future(self) -> Future:
        return self.answer


class Pool:
    """The rollout pool's side of a recovery: every dead replica restarted."""

    def __init__(self, group: Replicas):
        self.group, self.restarted = group, []

    def save(self, path: str) -> None:
        """The pool's own state: not this test's."""

    def load(self, path: str) -> None:
        """The pool's own state: not this test's."""

    def recover(self, cause: BaseException) -> list[int]:
        dead, self.group.dead = sorted(self.group.dead), set()
        self.restarted.append(dead)
        return dead


def routed(replicas: Replicas, tmp_path) -> RoutedAgentRollout:
    deadline = CallDeadline(60.0, "trainer.worker_call_timeout_s")
    return RoutedAgentRollout(Pool(replicas), lambda request: None, str(tmp_path), deadline)


async def three_turns(session: Session, first: list[int]) -> list[Completion]:
    ids, answers = list(first), []
    for turn in range(3):
        answers.append(await session.generate(ids, SamplingConfig(), seed=100 + turn, max_new=8))
        ids += [7, 7]
    return answers


def test_a_turn_lost_with_its_replica_is_asked_again_of_a_live_one_and_the_session_stays_there(tmp_path):
    replicas = Replicas(2, deaths={4})  # "b"'s second turn, on replica 1
    rollout = routed(replicas, tmp_path)
    sessions = [Session(rollout, name) for name in "ab"]

    async def both():
        return await asyncio.gather(three_turns(sessions[0], [1, 2]), three_turns(sessions[1], [3]))

    answers = asyncio.run(both())
    assert [[c.token_ids for c in session] for session in answers] == [[[2], [4], [6]], [[1], [3], [5]]]
    routes = [(r["session"], r["turn"], r["replica"], r["moved"]) for r in rollout.router.take_routes()]
    by_session = {name: [route[1:] for route in routes if route[0] == name] for name in "ab"}
    assert by_session == {
        "a": [(0, 0, False), (1, 0, False), (2, 0, False)],
        "b": [(0, 1, False), (1, 1, False), (1, 0, True), (2, 0, False)],  # turn 1 lost on 1, asked of 0
    }
    lost, again = [call for call in replicas.calls if call[1][0] == 3][1:3]  # b's turn 1, twice
    assert lost[1:] == again[1:] == ([3, 7, 7], 101) and (lost[0], again[0]) == (1, 0)  # same ids, seed
    assert [session.replica for session in sessions] == [0, 0]
    rollout.restart_lost()  # the call's end
    assert rollout.pool.restarted == [[1]] and rollout.router.live == {0, 1}


def test_with_every_replica_lost_they_are_restarted_before_the_turn_is_asked_again(tmp_path):
    replicas = Replicas(1, deaths={2})
    rollout = routed(replicas, tmp_path)
    answers = asyncio.run(three_turns(Session(rollout, "a"), [1]))
    assert [c.token_ids for c in answers] == [[1], [3], [5]]
    assert rollout.pool.restarted == [[0]]
    assert [call[0] for call in replicas.calls] == [0, 0, 0, 0]


def test_the_record_is_moved_aside_at_a_fresh_start_and_cut_to_the_checkpoints_lines_at_a_resume(tmp_path):
    (tmp_path / "router.jsonl").write_text("an earlier run's\n")
    rollout = routed(Replicas(2, deaths=set()), tmp_path)
    route = {"session": "42-0", "turn": 0, "replica": 0, "moved": False}
    rollout.record([route, route])
    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    rollout.save(str(checkpoint))
    rollout.record([{**route, "moved": True}])  # after the checkpoint: the resumed run routes it again
    resumed = routed(Replicas(2, deaths=set()), tmp_path)
    resumed.load(str(checkpoint))
    resumed.record([{**route, "turn": 1}])
    lines = (tmp_path / "router.jsonl").read_text().splitlines()
    assert [json.loads(line)["turn"] for line in lines] == [0, 0, 1]
    assert (tmp_path / "router.jsonl.1").read_text() == "an earlier run's\n"
    assert rollout.moved == 1 and resumed.moved == 0


def test_an_error_the_engine_raised_stops_the_call_naming_the_replica(tmp_path):
    rollout = routed(Replicas(2, deaths=set(), failures={2}), tmp_path)
    with pytest.raises(WorkerError, match="`generate_request` raised on rank 0: ValueError: the engine"):
        asyncio.run(three_turns(Session(rollout, "a"), [1]))
    assert rollout.router.live == {0, 1}  # not a lost replica: nothing moves, nothing restarts


class HungReplica(Replicas):
    """Replica 0's requests are never answered until it is first killed (its restart answers); its
    kill (in the rollout's thread) returns once `release` is set, as Ray's kill returns once it sees
    the process dead."""

    def __init__(self, world_size: int):
        super().__init__(world_size, deaths=set())
        self.killing, self.release = threading.Event(), threading.Event()
        self.kills: list[tuple[int, bool]] = []  # (rank, whether released before the wait's deadline)

    def call_rank_async(self, rank: int, method: str, ids, sampling, seed, max_new_tokens):
        if rank == 0 and not self.kills:
            self.calls.append((rank, list(ids), seed))
            return Call(Future())  # hung
        return super().call_rank_async(rank, method, ids, sampling, seed, max_new_tokens)

    def kill_rank(self, rank: int) -> None:
        self.killing.set()
        self.kills.append((rank, self.release.wait(timeout=30)))
        self.dead.add(rank)


def with_short_deadline(replicas: Replicas, tmp_path) -> RoutedAgentRollout:
    deadline = CallDeadline(0.01, "trainer.worker_call_timeout_s")  # a hung request's only
    return RoutedAgentRollout(Pool(replicas), lambda request: None, str(tmp_path), deadline)


async def when_killing(replicas: HungReplica) -> None:
    await asyncio.to_thread(replicas.killing.wait, 30)


def test_a_hung_replica_is_killed_while_the_other_sessions_turns_go_on(tmp_path):
    replicas = HungReplica(2)
    rollout = with_short_deadline(replicas, tmp_path)
    hung, other = Session(rollout, "hung"), Session(rollout, "other")

    async def answered_during_the_kill() -> list[Completion]:
        await when_killing(replicas)
        answers = await three_turns(other, [5])  # on replica 1, while replica 0's kill waits
        replicas.release.set()
        return answers

    async def both():
        return await asyncio.gather(hung.generate([2], SamplingConfig(), 1, 8), answered_during_the_kill())

    moved, others = asyncio.run(both())
    assert replicas.kills == [(0, True)]  # the event loop was not held up by the kill
    assert moved.token_ids == [1] and [c.token_ids for c in others] == [[1], [3], [5]]
    assert "rank 0" in str(rollout.lost_errors[0]) and "worker_call_timeout_s" in str(rollout.lost_errors[0])
    rollout.restart_lost()
    assert rollout.pool.restarted == [[0]]


def test_with_every_replica_lost_the_restart_waits_for_the_kill_under_way(tmp_path):
    replicas = HungReplica(1)
    rollout = with_short_deadline(replicas, tmp_path)
    hung, later = Session(rollout, "hung"), Session(rollout, "later")

    async def routed_during_the_kill() -> Completion:
        await when_killing(replicas)
        turn = asyncio.ensure_future(later.generate([3, 4], SamplingConfig(), 2, 8))
        await asyncio.sleep(0)  # the turn runs until it waits: no live replica, one being killed
        replicas.release.set()
        return await turn

    async def both():
        return await asyncio.gather(hung.generate([2], SamplingConfig(), 1, 8), routed_during_the_kill())

    answers = asyncio.run(both())
    assert [c.token_ids for c in answers] == [[1], [2]]
    assert rollout.pool.restarted == [[0]]  # once, after the kill: the killed replica was dead then
