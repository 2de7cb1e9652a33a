"""Streaming rollout (trainer.async_training.mode=stream): the rollout pool never waits for a
batch's longest response, and a training step never waits for more than its own groups.

With real response lengths (most short, a few at the limit) a whole-batch generation leaves the
engines idle while its tail finishes. Here every prompt's n samples are one group, a generation
call of its own on one rollout process (its requests share the engine's decoding steps with every
other group's, engines/rollout/request_batches.py), and

    step k (trained with version v, the policy's at the step's sync; weights land between decoding
    steps; A = max_staleness - sync_every + 1, the batches generating ahead):
        submit groups until (A + 1) x train_batch_size are outstanding
        take finished groups in completion order until train_batch_size are taken; a group whose
            oldest token is more than max_staleness versions behind v is dropped or regenerated
            (trainer.async_training.stale_groups), counted, never trained
        submit groups until A x train_batch_size are outstanding (they generate while the step
            trains)

With sync_every k (trainer.async_training) a step's sync transfers only once the engines trail the
policy by k updates (`pool.sync_due`), so groups generate with weights up to k - 1 updates older
than the step's; A is max_staleness less that lag (the recipe check refuses sync_every >
max_staleness), and the take-time check is against v, the version trained, not the engines'.

Outstanding counts groups generating and groups finished but not taken: AReaL's bound
(`max_head_offpolicyness`), under which groups taken in submission order are never staler than
max_staleness; taken in completion order, a slow group is overtaken and may be, which the take-time
check catches. The step's prompt rows (uid, ground truth) are the taken groups' own
(`responses` returns them with the responses). Prompts are drawn from the loader as slots free up.

What a run samples and trains depends on timing only through which groups a step takes and where
a weight update lands in a group still generating: every group call carries the pool's next seed
(rollout.seed + k, k counting the pool's calls, as the pool's own calls do), where an engine given
none would take the next of its own in the order the concurrent calls reach it; and a step's
groups are batched in submission order, not completion order (the order decides the
micro-batches, so the update's rounding).

Checkpoints hold what is outstanding: finished groups with their responses, and the prompts of
groups still generating (regenerated after a resume) or drawn and not submitted. A resumed run
takes them under the same check, so it never trains a sample staler than the bound.

A rollout process that dies: `lost_process` restarts it through the pool's `recover()` where the
pool has one and submits the groups lost there again from their prompts; otherwise the run stops
with `RolloutProcessDied`, as in the other modes.
"""

import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

import torch

from engines.rollout.base import is_validation
from hybridflow.protocol import DataProto
from hybridflow.single_controller.errors import CallDeadline, WorkerError, call_timeout
from hybridflow.trainer.dynamic_sampling import PROMPT_SIDE, concat_rounds
from hybridflow.trainer.policy import Policy
from hybridflow.trainer.prompts import PromptBatches, StepPrompts
from hybridflow.trainer.rollout.pool import PoolRollout, RolloutProcessDied, naming_dead_processes
from hybridflow.trainer.rollout.unread import STREAM_FILE  # in the rollout's checkpoint directory
from hybridflow.workers.protocols import RolloutGroup


@dataclass
class StreamSettings:
    n: int  # samples per prompt: a group
    groups_per_step: int  # data.train_batch_size
    max_staleness: int
    stale_groups: Literal["drop", "regenerate"]
    pad_token_id: int
    sync_every: int = 1  # updates between weight transfers to the engines

    def batches_ahead(self) -> int:
        """Batches generating ahead of the one trained: the bound less the engines' lag."""
        return self.max_staleness - (self.sync_every - 1)

    @classmethod
    def of(cls, cfg, pad_token_id: int) -> "StreamSettings":
        settings = cfg.trainer.async_training
        return cls(
            cfg.rollout.sampling.n,
            cfg.data.train_batch_size,
            settings.max_staleness,
            settings.stale_groups,
            pad_token_id,
            settings.sync_every,
        )


@dataclass
class Group:
    """One prompt's n samples: its step row, the rows generated from, and once finished the
    responses; `rank`, `submitted` (wall clock) and `seed` once submitted."""

    batch: DataProto  # 1 row: uid, ground truth, data source
    prompt: DataProto  # 1 row: the prompt tensors
    rows: DataProto  # n rows: what the engine generates from
    responses: DataProto | None = None
    rank: int = -1
    submitted: float = 0.0
    seed: int = -1  # the call's sampling seed once submitted: grows with each submission

    def version(self) -> int:
        """The policy version of the group's oldest token."""
        return int(self.responses.batch["policy_version"].min())

    def again(self) -> "Group":
        """The same prompt, to generate again."""
        return Group(self.batch, self.prompt, self.rows)


class GroupCalls(Protocol):
    """One generation call per group on one rollout process, awaited in completion order."""

    ranks: int

    def submit(self, rows: DataProto) -> tuple[Any, int]:
        """Start generating `rows`; the call's handle and the rank it runs on."""

    def wait(self, handles: list, block: bool = True) -> list:
        """The finished ones of `handles`; with `block`, at least one (waiting for it)."""

    def result(self, handle) -> DataProto:
        """A finished call's responses (WorkerError naming the rank when it failed)."""


@dataclass(frozen=True)
class EngineDeadlines:
    """When a group call's engine is health-checked, how long the check may take, and the hard bound
    of a call whose engine answers it (rollout.engine_call_timeout_s,
    rollout.engine_health_check_timeout_s, trainer.worker_call_timeout_s)."""

    check_after_s: float = 600.0
    check_s: float = 60.0
    bound_s: float = 3600.0

    @classmethod
    def of(cls, cfg) -> "EngineDeadlines":
        rollout = cfg.rollout
        return cls(
            rollout.engine_call_timeout_s,
            rollout.engine_health_check_timeout_s,
            cfg.trainer.worker_call_timeout_s,
        )


class RayGroupCalls:
    """`GroupCalls` on the rollout worker group's processes: each group goes to the process with
    the fewest calls in flight, as a call of `generate_sequences` on that rank alone
    (`RayWorkerGroup.call_rank_async`).

    A call still running `check_after_s` after it started gets its engine health-checked (the
    worker's `health_check`, which its engine's loop answers between two decoding steps): an engine
    that does not answer within `check_s` is hung; one whose call passes `bound_s` is too. A hung
    engine's process is killed, so that its calls fail as a dead process's do and the pool
    restarts it (`result` raises the CallTimeout naming the rank and the call it hung in)."""

    def __init__(self, group: RolloutGroup, deadlines: EngineDeadlines | None = None, clock=time.monotonic):
        self.group = group  # the rollout RayWorkerGroup (a restarted rank's calls go to its new process)
        self.deadlines = deadlines or EngineDeadlines()
        self.clock = clock
        self.rank_of: dict = {}  # in-flight call -> rank
        self.started: dict = {}  # in-flight call -> when it was submitted (clock)
        self.checked: dict[int, float] = {}  # rank -> when its engine last answered a health check
        self.hung: dict = {}  # call on a process killed as hung -> the CallTimeout to raise

    @property
    def ranks(self) -> int:
        return self.group.world_size

    def submit(self, rows: DataProto) -> tuple[Any, int]:
        busy = [0] * self.ranks
        for rank in self.rank_of.values():
            busy[rank] += 1
        rank = busy.index(min(busy))
        handle = self.group.call_rank_async(rank, "generate_sequences", rows)
        self.rank_of[handle], self.started[handle] = rank, self.clock()
        return handle, rank

    def wait(self, handles: list, block: bool = True) -> list:
        if block:
            while not self.group.wait_calls(handles, count=1, wait_s=self.until_next_check(handles)):
                self.check_engines(handles)
        return self.group.wait_calls(handles, wait_s=0)

    def until_next_check(self, handles: list) -> float | None:
        """Seconds until the oldest of `handles` is due for its engine's health check (None: all are
        on processes killed as hung, whose calls fail at once)."""
        dues = [self.due(handle) for handle in handles if handle not in self.hung]
        return max(0.0, min(dues) - self.clock()) if dues else None

    def due(self, handle) -> float:
        """When the call's engine is next checked: `check_after_s` after the call started or after
        its engine last answered a check (`bound_s` after the call started at the latest)."""
        since = max(self.started.get(handle, 0.0), self.checked.get(self.rank_of.get(handle, -1), 0.0))
        return min(
            since + self.deadlines.check_after_s, self.started.get(handle, 0.0) + self.deadlines.bound_s
        )

    def check_engines(self, handles: list) -> None:
        """Every engine with a call due: answers the health check (busy: the call goes on), or is
        killed as hung."""
        now = self.clock()
        due = {
            self.rank_of[h]
            for h in handles
            if h in self.rank_of and h not in self.hung and self.due(h) <= now
        }
        for rank in sorted(due):
            oldest = min((h for h in handles if self.rank_of.get(h) == rank), key=self.started.get)
            if now - self.started[oldest] >= self.deadlines.bound_s:
                self.kill_hung(rank, self.deadlines.bound_s, "trainer.worker_call_timeout_s", "")
            elif self.answers_health_check(rank):
                self.checked[rank] = self.clock()
            else:
                what = f" nor its health check within {self.deadlines.check_s:g}s"
                self.kill_hung(rank, self.deadlines.check_after_s, "rollout.engine_call_timeout_s", what)

    def answers_health_check(self, rank: int) -> bool:
        call = self.group.call_rank_async(rank, "health_check")
        done = self.group.wait_calls([call], wait_s=self.deadlines.check_s)
        try:
            return bool(done) and self.group.call_result(done[0], rank, "health_check") is None
        except WorkerError:
            return False  # dead or failing: its calls fail on their own, or are killed with it

    def kill_hung(self, rank: int, seconds: float, setting: str, what: str) -> None:
        """The hung process killed: its calls fail now, each with the CallTimeout naming it."""
        error = call_timeout(
            "rollout engine", rank, "generate_sequences", CallDeadline(seconds, setting), what
        )
        print(f"rollout pool: {error}; killing it as hung", flush=True)
        for handle, on in self.rank_of.items():
            if on == rank:
                self.hung[handle] = error
        self.checked.pop(rank, None)
        self.group.kill_rank(rank)

    def result(self, handle) -> DataProto:
        rank = self.rank_of.pop(handle)
        self.started.pop(handle, None)
        if handle in self.hung:
            raise self.hung.pop(handle)
        return self.group.call_result(handle, rank, "generate_sequences")

    def forget(self, handle) -> None:
        self.rank_of.pop(handle, None)
        self.started.pop(handle, None)
        self.hung.pop(handle, None)


def split_groups(step: StepPrompts, n: int) -> list[Group]:
    """A loader batch's prompts as groups, in order."""
    return [
        Group(step.batch[i : i + 1], step.prompts[i : i + 1], step.rows[i * n : (i + 1) * n])
        for i in range(len(step.batch))
    ]


def left_pad(prompts: DataProto, width: int, pad_token_id: int) -> DataProto:
    """Prompt rows with their (B, P) tensors left-padded to `width`."""
    extra = width - prompts.batch["input_ids"].size(1)
    padded = dict(prompts.batch.items())
    for key in padded:
        fill = pad_token_id if PROMPT_SIDE[key] is None else PROMPT_SIDE[key]
        padded[key] = torch.nn.functional.pad(padded[key], (extra, 0), value=fill)  # (B, width)
    return DataProto.from_dict(padded, non_tensors=prompts.non_tensor_batch, meta_info=prompts.meta_info)


def join_prompts(parts: list[DataProto], pad_token_id: int) -> DataProto:
    """Prompt rows of several loader batches (each padded to its own width) as one."""
    width = max(part.batch["input_ids"].size(1) for part in parts)
    return DataProto.concat([left_pad(part, width, pad_token_id) for part in parts])


def union_seconds(intervals: list[tuple[float, float]]) -> float:
    """Seconds covered by the (start, end) intervals, overlaps counted once."""
    covered, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        covered += max(0.0, end - max(start, reach))
        reach = max(reach, end)
    return covered


@dataclass
class StreamCounts:
    """What happened since the last trained batch's metrics."""

    since: float
    finished: int = 0  # groups finished (taken or not)
    dropped: int = 0  # stale: dropped, or regenerated
    windows: list[tuple[int, float, float]] = field(default_factory=list)  # rank, call start, end
    generating_at_validation: int = 0  # most groups in flight when a validation call began
    finished_during_validation: int = 0  # groups that finished while validation generated


class StreamingRollout:
    def __init__(self, pool: PoolRollout, calls: GroupCalls, settings: StreamSettings, clock=time.time):
        self.pool, self.calls, self.settings = pool, calls, settings
        self.clock = clock  # wall clock, as the rollout processes' call windows are
        self.unsent: deque[Group] = deque()  # drawn, not submitted (regenerations first)
        self.in_flight: dict[Any, Group] = {}  # by call handle
        self.finished: deque[Group] = deque()  # completion order
        self.counts = StreamCounts(since=clock())
        self.dropped_total = 0

    def sync_weights(self, policy: Policy) -> None:
        """Lands between two decoding steps of the groups in flight, which continue under it."""
        self.pool.sync_weights(policy, self.settings.sync_every)

    def generate(self, rows: DataProto) -> DataProto:
        """Now, with the newest weights (transferred first where sync_every left the engines
        behind), beside the groups in flight, which generate on: the pipeline is not drained. For a
        validation call, the groups in flight at its start and those that finished during it are
        counted (the next step's metrics)."""
        self.pool.newest_weights()
        self.collect(block=False)  # groups finished before the call: not counted as during it
        generating, finished = len(self.in_flight), self.counts.finished
        responses = self.pool.generate(rows)
        self.collect(block=False)
        if is_validation(rows.meta_info):
            counts = self.counts
            counts.generating_at_validation = max(counts.generating_at_validation, generating)
            counts.finished_during_validation += counts.finished - finished
        return responses

    def responses(self, prompts: PromptBatches, steps_left: int) -> tuple[StepPrompts, DataProto]:
        """The next `groups_per_step` finished groups fresh enough to train with the version last
        synced: their prompt rows and responses."""
        per_step, ahead = self.settings.groups_per_step, self.settings.batches_ahead()
        waiting = min(ahead + 1, steps_left + 1) * per_step
        self.fill(prompts, waiting)
        groups = self.take(prompts, waiting)
        self.fill(prompts, min(ahead, steps_left) * per_step)  # they generate while the step trains
        pad = self.settings.pad_token_id
        return self.step_prompts(groups), concat_rounds([group.responses for group in groups], pad)

    def take(self, prompts: PromptBatches, waiting: int) -> list[Group]:
        """The step's groups: the first to finish, in submission order; stale ones are replaced (up
        to `waiting` outstanding, the taken ones included)."""
        groups = []
        while len(groups) < self.settings.groups_per_step:
            group = self.next_finished()
            if self.pool.synced - group.version() > self.settings.max_staleness:
                self.stale(group)
                self.fill(prompts, waiting - len(groups))
            else:
                groups.append(group)
        return sorted(groups, key=lambda group: group.seed)

    def outstanding(self) -> int:
        return len(self.in_flight) + len(self.finished)

    def fill(self, prompts: PromptBatches, limit: int) -> None:
        """Submit groups until `limit` are outstanding, drawing prompts from the loader as needed."""
        while self.outstanding() < limit:
            if not self.unsent:
                self.unsent.extend(split_groups(prompts.draw(), self.settings.n))
            self.submit(self.unsent.popleft())

    def submit(self, group: Group) -> None:
        rows = self.pool.seeded(group.rows)  # the pool's next seed: not the engine's arrival order
        group.seed = rows.meta_info["seed"]
        handle, group.rank = self.calls.submit(rows)
        group.submitted = self.clock()
        self.in_flight[handle] = group

    def next_finished(self) -> Group:
        """The oldest finished group, waiting for one if none is."""
        while not self.finished:
            if not self.in_flight:
                raise RuntimeError("stream: waiting for a finished group with none generating")
            self.collect(block=True)
        return self.finished.popleft()

    def collect(self, block: bool) -> None:
        """Finished calls into `finished`; with `block`, at least one."""
        if self.in_flight:
            for handle in self.calls.wait(list(self.in_flight), block):
                if handle in self.in_flight:  # not lost with a dead process meanwhile
                    self.finish(handle)

    def finish(self, handle) -> None:
        group = self.in_flight[handle]
        try:
            with naming_dead_processes():
                group.responses = self.calls.result(handle)
        except RolloutProcessDied as died:
            self.lost_process(died, handle)
            return
        group.responses.meta_info.pop("seed", None)  # the call's, not the batch's
        del self.in_flight[handle]
        self.finished.append(group)
        window = group.responses.batch["generation_window"][0].tolist()  # (2,): the call's start, end
        self.counts.windows.append((group.rank, *window))
        self.counts.finished += 1

    def lost_process(self, died: RolloutProcessDied, failed) -> None:
        """The call `failed` met a dead rollout process: the pool restarts dead processes
        (`recover()`: the ranks it restarted, with the current weights; none when an earlier call's
        recovery restarted this one already; RolloutProcessDied beyond rollout.max_engine_restarts,
        which stops the run), then that call and every group on a restarted rank are submitted again
        from their prompts."""
        restarted = set(self.pool.recover(died.__cause__))
        lost = [handle for handle, group in self.in_flight.items() if group.rank in restarted]
        if failed not in lost:
            lost.append(failed)
        for handle in lost:
            self.calls.forget(handle)
            self.submit(self.in_flight.pop(handle).again())

    def stale(self, group: Group) -> None:
        """Never trained: its prompt is generated again with the newest weights, or skipped."""
        self.counts.dropped += 1
        self.dropped_total += 1
        if self.settings.stale_groups == "regenerate":
            self.unsent.appendleft(group.again())

    def step_prompts(self, groups: list[Group]) -> StepPrompts:
        pad = self.settings.pad_token_id
        return StepPrompts(
            DataProto.concat([g.batch for g in groups]),
            join_prompts([g.prompt for g in groups], pad),
            join_prompts([g.rows for g in groups], pad),
        )

    def metrics(self, batch: DataProto) -> dict[str, float]:
        """The pool's staleness metrics and the stream's since the last trained batch: stale groups
        (dropped or regenerated) and their share of the groups finished, groups outstanding, the
        share of the time each engine had requests in flight, samples generated per second."""
        self.collect(block=False)  # what finished while the step trained: the queue's depth
        now, counts = self.clock(), self.counts
        seconds = max(now - counts.since, 1e-9)
        self.counts = StreamCounts(since=now)
        return {
            **self.pool.metrics(batch),
            "stream/stale_groups": float(counts.dropped),
            "stream/stale_groups_total": float(self.dropped_total),
            "stream/stale_group_share": counts.dropped / max(counts.finished, 1),
            "stream/in_flight_groups": float(len(self.in_flight)),  # at the step's end
            "stream/finished_queue": float(len(self.finished)),  # finished, not taken yet
            "stream/engine_busy_share": self.busy_seconds(counts, now) / seconds / self.calls.ranks,
            "stream/samples_per_s": counts.finished * self.settings.n / seconds,
            "stream/groups_generating_at_validation": float(counts.generating_at_validation),
            "stream/groups_finished_during_validation": float(counts.finished_during_validation),
        }

    def busy_seconds(self, counts: StreamCounts, now: float) -> float:
        """Seconds since `counts.since`, summed over the engines, with a call in flight."""
        calls = counts.windows + [(g.rank, g.submitted, now) for g in self.in_flight.values()]
        by_rank: dict[int, list[tuple[float, float]]] = {}
        for rank, start, end in calls:
            by_rank.setdefault(rank, []).append((max(start, counts.since), max(end, counts.since)))
        return sum(union_seconds(intervals) for intervals in by_rank.values())

    def save(self, path: str) -> None:
        """What is outstanding: finished groups with their responses; the prompts of groups still
        generating (they generate on, and are regenerated in a resumed run) and of drawn ones."""
        self.pool.save(path)
        generating = [group.again() for group in self.in_flight.values()]
        unsent = generating + [group.again() for group in self.unsent]
        state = {"finished": list(self.finished), "unsent": unsent, "stale_total": self.dropped_total}
        torch.save(state, Path(path) / STREAM_FILE)

    def load(self, path: str) -> None:
        self.pool.load(path, reads=STREAM_FILE)
        saved = Path(path) / STREAM_FILE
        if saved.is_file():  # absent in another mode's checkpoint
            state = torch.load(saved, weights_only=False)  # our own file: DataProtos
            self.finished, self.unsent = deque(state["finished"]), deque(state["unsent"])
            self.dropped_total = state["stale_total"]
