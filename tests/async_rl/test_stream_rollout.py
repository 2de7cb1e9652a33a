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

import pytest
from stream_fakes import PROMPTS, RecoveringPool, check_batch, length, stream_trainer, train_step

from hybridflow.trainer.rollout.pool import PoolRollout, RolloutProcessDied
from hybridflow.trainer.rollout.stream import union_seconds


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
