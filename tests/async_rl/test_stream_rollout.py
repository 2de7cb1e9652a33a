"""StreamingRollout (trainer.async_training.mode=stream) against fake engines, through the trainer's
own `generate` and the real PoolRollout (its weight sync and policy_versions.jsonl): no processes.

The fake engines run on a virtual clock: a group finishes `length(problem)` ticks after it starts,
its tokens of the version served when it was submitted (the oldest token's), and a training step
advances the clock by TRAIN_TICKS. Lengths are heavy-tailed: every fifth problem takes 12 steps'
worth of ticks, so some groups are overtaken and finish beyond the staleness bound. Checked: every
step trains whole groups on their own prompt rows (ground truth, uid), none staler than the bound;
stale groups are counted and dropped or regenerated; a save in mid-run and a load into a fresh
stream resume with nothing staler than the bound and no prompt lost; a dead rollout process is
recovered through the pool's `recover()` where it restarts one, and stops the run where it cannot.
"""

import json
from types import SimpleNamespace

import numpy as np
import pytest
import ray.exceptions
import torch

from hybridflow.protocol import DataProto
from hybridflow.single_controller.errors import worker_error
from hybridflow.trainer.policy import Policy
from hybridflow.trainer.ppo_trainer import PPOTrainer
from hybridflow.trainer.prompts import PromptBatches
from hybridflow.trainer.rollout.pool import PoolRollout, RolloutProcessDied
from hybridflow.trainer.rollout.stream import StreamingRollout, StreamSettings, union_seconds

PROMPTS, N, TRAIN_TICKS = 4, 2, 10  # prompts per step (train_batch_size), samples per prompt


def length(problem: int) -> int:
    """Ticks a group of `problem` generates: mostly short, every fifth one very long."""
    return 12 * TRAIN_TICKS if problem % 5 == 4 else 1 + problem % 3


class Engines:
    """The rollout pool's processes on a virtual clock; `serving` is the version last transferred."""

    def __init__(self, ranks: int = 2):
        self.ranks, self.clock, self.serving = ranks, 0, None
        self.calls: dict[int, dict] = {}  # handle -> rank, rows, version, end
        self.submitted: list[dict] = []  # every call, in submission order
        self.dead: set[int] = set()  # ranks whose process died
        self.handles = 0

    def submit(self, rows: DataProto) -> tuple[int, int]:
        rank = self.handles % self.ranks
        self.handles += 1
        problem = int(rows.batch["input_ids"][0, -1])
        end = self.clock + length(problem)
        call = {"rank": rank, "rows": rows, "version": self.serving, "start": self.clock, "end": end}
        self.calls[self.handles] = call
        self.submitted.append(call)
        return self.handles, rank

    def wait(self, handles: list, block: bool = True) -> list:
        if block:
            self.clock = max(self.clock, min(self.calls[h]["end"] for h in handles))
        return [h for h in handles if self.calls[h]["end"] <= self.clock]

    def kill(self, rank: int) -> None:
        """The process of `rank` dies: its calls in flight are lost."""
        self.dead.add(rank)
        for call in self.calls.values():
            call["lost"] = call.get("lost", False) or call["rank"] == rank

    def result(self, handle) -> DataProto:
        call = self.calls.pop(handle)
        if call["rank"] in self.dead or call.get("lost"):
            raise worker_error(ray.exceptions.RayActorError(), call["rank"], "generate_sequences")
        rows = call["rows"]
        problem = rows.batch["input_ids"][:, -1:].clone()  # (n, 1): the problem the rows ask
        window = torch.tensor([[float(call["start"]), float(call["end"])]]).repeat(len(rows), 1)  # (n, 2)
        batch = {
            "prompts": rows.batch["input_ids"],
            "responses": problem,
            "policy_version": torch.full((len(rows),), call["version"]),  # (n,)
            "generation_window": window,
        }
        return DataProto.from_dict(batch, meta_info=dict(rows.meta_info))  # as the engines' output

    def forget(self, handle) -> None:
        self.calls.pop(handle, None)


class RolloutGroup:
    """The pool's side of a transfer (the engines serve the version sent) and its checkpoint."""

    def __init__(self, engines: Engines):
        self.engines = engines

    def start_receive_weights(self) -> None:
        pass

    def send(self, version: int) -> None:
        self.engines.serving = version

    def finish_transfer(self) -> list[int]:
        return [self.engines.serving]

    def dead_ranks(self) -> list[int]:
        return sorted(self.engines.dead)

    def save_rng_state(self, path: str) -> None:
        pass

    def advance_rng_state(self, position: dict) -> None:
        pass

    def load_rng_state(self, path: str) -> list[dict]:
        return [{"calls": 0, "val_calls": 0}] * self.engines.ranks


class RecoveringPool(PoolRollout):
    """A pool whose dead processes restart (`recover()`, the restarted ranks)."""

    def recover(self, cause: BaseException | None = None) -> list[int]:
        restarted = sorted(self.group.engines.dead)
        self.group.engines.dead.clear()
        return restarted


class Loader:
    """Batch i asks problems PROMPTS i .. PROMPTS i + PROMPTS - 1 (each its own ground truth);
    the prompt width grows with i, so groups of different batches need padding to be joined."""

    def __init__(self):
        self.batches = 0

    def next_batch(self) -> dict:
        problems = torch.arange(PROMPTS) + PROMPTS * self.batches
        self.batches += 1
        ids = problems[:, None].repeat(1, 2 + self.batches % 3)  # (P, W)
        return {
            "input_ids": ids,
            "attention_mask": torch.ones_like(ids),
            "position_ids": torch.arange(ids.size(1)).repeat(PROMPTS, 1),
            "ground_truth": np.array([str(p) for p in problems.tolist()], dtype=object),
        }


def stream_trainer(tmp_path, stale_groups="drop", bound=1, pool_cls=PoolRollout, loader=None):
    engines = Engines()
    group = RolloutGroup(engines)
    policy = Policy(SimpleNamespace(send_weights=group.send))
    pool = pool_cls(group, str(tmp_path))
    settings = StreamSettings(N, PROMPTS, bound, stale_groups, pad_token_id=0)
    cfg = SimpleNamespace(
        rollout=SimpleNamespace(sampling=SimpleNamespace(n=N)),
        algorithm=SimpleNamespace(adv_estimator="grpo"),
    )
    return SimpleNamespace(
        cfg=cfg,
        global_step=0,
        total_steps=12,
        prompts=PromptBatches(loader or Loader(), N, with_rows=False),
        rollout=StreamingRollout(pool, engines, settings, clock=lambda: float(engines.clock)),
        policy=policy,
        engines=engines,
    )


def train_step(trainer) -> tuple[DataProto, dict]:
    """The loop's lines that concern the rollout: sync, responses, an update, the metrics."""
    trainer.global_step += 1
    trainer.rollout.sync_weights(trainer.policy)
    batch = PPOTrainer.generate(trainer, {})
    trainer.engines.clock += TRAIN_TICKS  # the step trains; the groups in flight generate on
    trainer.policy.version += 1
    return batch, trainer.rollout.metrics(batch)


def check_batch(batch: DataProto, trained_on: int, bound: int) -> list[int]:
    """Whole groups on their own rows, no sample staler than `bound`; the batch's problems."""
    answers = [str(p) for p in batch.batch["responses"][:, 0].tolist()]
    assert answers == list(batch.non_tensor_batch["ground_truth"]), "responses of other rows"
    uids = batch.non_tensor_batch["uid"]
    assert len(set(uids)) == PROMPTS and all(list(uids).count(u) == N for u in uids)
    staleness = trained_on - batch.batch["policy_version"]
    assert int(staleness.max()) <= bound and int(staleness.min()) >= 0
    return batch.batch["responses"][::N, 0].tolist()


@pytest.mark.parametrize("bound", [1, 2])
def test_each_step_trains_finished_groups_within_the_bound_and_counts_the_stale_ones(tmp_path, bound):
    trainer = stream_trainer(tmp_path, bound=bound)
    stale = 0
    for _ in range(trainer.total_steps):
        batch, metrics = train_step(trainer)
        check_batch(batch, trainer.policy.version - 1, bound)
        stale += metrics["stream/stale_groups"]
        assert metrics["stream/stale_groups_total"] == stale
        assert 0 < metrics["stream/engine_busy_share"] <= 1
        assert metrics["async/staleness_max"] <= bound
    assert stale > 0  # the long groups were overtaken beyond the bound, and dropped
    versions = [json.loads(line) for line in (tmp_path / "policy_versions.jsonl").read_text().splitlines()]
    assert [v["trained_on"] for v in versions] == list(range(trainer.total_steps))
    assert all(0 <= v["trained_on"] - s <= bound for v in versions for s in v["sample_versions"])


def test_a_step_takes_short_groups_before_a_long_one_ends(tmp_path):
    """Completion order: the first step does not wait for problem 4, which outlasts several steps."""
    trainer = stream_trainer(tmp_path)
    batch, _ = train_step(trainer)
    assert 4 not in check_batch(batch, 0, 1)
    assert trainer.engines.clock < length(4)


def test_a_steps_batch_is_in_submission_order_whatever_order_its_groups_finished(tmp_path):
    """Which groups a step takes is timing (the first to finish); their order in the batch is not,
    since it decides the micro-batches and so the update's rounding: a run must not depend on it."""
    trainer = stream_trainer(tmp_path)
    batch, _ = train_step(trainer)
    assert check_batch(batch, 0, 1) == [0, 1, 3, 6]  # finished in the order 0, 3, 6, 1


@pytest.mark.parametrize("stale_groups", ["drop", "regenerate"])
def test_each_group_samples_with_the_pools_next_seed_in_submission_order(tmp_path, stale_groups):
    """Concurrent group calls reach an engine in an order that is timing, and an engine without a
    seed given takes rollout.seed + (its calls so far): each call carries the pool's next seed
    instead (rollout.seed + k, k counting the pool's calls), so a group samples alike whatever that
    order; regenerated groups get seeds of their own. The call's seed stays out of the batch."""
    trainer = stream_trainer(tmp_path, stale_groups=stale_groups)
    for _ in range(trainer.total_steps):
        batch, _ = train_step(trainer)
        assert "seed" not in batch.meta_info
    seeds = [call["rows"].meta_info.get("seed") for call in trainer.engines.submitted]
    base = trainer.rollout.pool.seed
    assert seeds == [base + k for k in range(len(seeds))]
    assert trainer.rollout.dropped_total > 0  # stale groups were met, and resubmitted when regenerated


def test_regenerated_groups_train_their_prompt_later_and_no_prompt_is_lost(tmp_path):
    trainer = stream_trainer(tmp_path, stale_groups="regenerate")
    trained = []
    for _ in range(trainer.total_steps):
        trained += check_batch(train_step(trainer)[0], trainer.policy.version - 1, 1)
    rollout = trainer.rollout
    assert rollout.dropped_total > 0
    outstanding = [g.batch.non_tensor_batch["ground_truth"][0] for g in rollout.in_flight.values()]
    outstanding += [g.batch.non_tensor_batch["ground_truth"][0] for g in (*rollout.finished, *rollout.unsent)]
    drawn = PROMPTS * trainer.prompts.loader.batches
    assert sorted(trained + [int(p) for p in outstanding]) == list(range(drawn))  # each once
    assert 4 in trained  # the long prompt, regenerated with newer weights, made it in the end


def test_a_resumed_stream_trains_nothing_staler_than_the_bound_and_loses_no_prompt(tmp_path):
    """Saved in mid-run (groups finished, generating and drawn), loaded into a fresh stream over
    fresh engines: the finished groups are taken under the same check, the others regenerated."""
    whole = stream_trainer(tmp_path / "whole", stale_groups="regenerate")
    (tmp_path / "whole").mkdir()
    trained = []
    for _ in range(3):
        trained += check_batch(train_step(whole)[0], whole.policy.version - 1, 1)
    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    whole.rollout.save(str(checkpoint))
    assert whole.rollout.in_flight and whole.rollout.finished  # something of each kind to save
    (tmp_path / "resumed").mkdir()
    # the loader where the checkpoint's data position left it; the policy's version restored
    resumed = stream_trainer(tmp_path / "resumed", stale_groups="regenerate", loader=whole.prompts.loader)
    resumed.rollout.load(str(checkpoint))
    resumed.policy.version = resumed.global_step = 3
    for _ in range(6):
        trained += check_batch(train_step(resumed)[0], resumed.policy.version - 1, 1)
    rollout = resumed.rollout
    outstanding = [*rollout.in_flight.values(), *rollout.finished, *rollout.unsent]
    problems = trained + [int(g.batch.non_tensor_batch["ground_truth"][0]) for g in outstanding]
    assert sorted(problems) == list(range(PROMPTS * resumed.prompts.loader.batches))  # each once


def test_a_run_resumed_in_its_directory_keeps_the_version_lines_up_to_its_checkpoint(tmp_path):
    """policy_versions.jsonl, like metrics.jsonl: the lines the interrupted run wrote after the
    checkpoint go, so each trained step has one line."""
    run = stream_trainer(tmp_path, stale_groups="regenerate")
    for _ in range(3):
        train_step(run)
    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    run.rollout.save(str(checkpoint))
    versions = tmp_path / "policy_versions.jsonl"
    saved = versions.read_text().splitlines()
    for _ in range(2):  # the interrupted run went on past its checkpoint
        train_step(run)
    assert len(versions.read_text().splitlines()) == 5
    resumed = stream_trainer(tmp_path, stale_groups="regenerate", loader=run.prompts.loader)
    resumed.rollout.load(str(checkpoint))
    assert versions.read_text().splitlines() == saved
    resumed.policy.version = resumed.global_step = 3
    train_step(resumed)
    lines = [json.loads(line) for line in versions.read_text().splitlines()]
    assert [line["trained_on"] for line in lines] == [0, 1, 2, 3]


def dead_rank_trainer(tmp_path, pool_cls):
    trainer = stream_trainer(tmp_path, pool_cls=pool_cls)
    train_step(trainer)
    trainer.engines.kill(1)  # rank 1's process dies with groups in flight
    return trainer


def test_a_dead_process_is_restarted_by_the_pool_and_its_groups_generated_again(tmp_path):
    trainer = dead_rank_trainer(tmp_path, RecoveringPool)
    trained = []
    for _ in range(4):
        trained += check_batch(train_step(trainer)[0], trainer.policy.version - 1, 1)
    assert len(trained) == len(set(trained)) and not trainer.engines.dead


def test_groups_lost_with_a_process_restarted_by_another_call_are_generated_again(tmp_path):
    """The weight sync met the death first and restarted the process: the stream's calls on it
    fail later, when recover() has nothing left to restart."""
    trainer = dead_rank_trainer(tmp_path, RecoveringPool)
    assert trainer.rollout.pool.recover() == [1]
    trained = []
    for _ in range(4):
        trained += check_batch(train_step(trainer)[0], trainer.policy.version - 1, 1)
    assert len(trained) == len(set(trained))


def test_a_dead_process_stops_the_run_where_the_pool_cannot_restart_it(tmp_path):
    trainer = dead_rank_trainer(tmp_path, PoolRollout)
    with pytest.raises(RolloutProcessDied, match="rollout pool process 1 died"):  # no restart allowed
        for _ in range(4):
            train_step(trainer)


def test_union_seconds_by_hand():
    assert union_seconds([(0.0, 2.0), (1.0, 3.0), (5.0, 6.0)]) == 4.0
    assert union_seconds([(1.0, 2.0), (0.0, 4.0)]) == 4.0
    assert union_seconds([]) == 0.0
