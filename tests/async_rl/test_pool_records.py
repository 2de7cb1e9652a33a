"""What the rollout pool records and carries over a resume, in every async mode, with the fake
engines of test_stream_rollout.py and the real PoolRollout (its restart, `recover()`, included):

- a rollout process found dead by the step's metrics (after the update) is restarted with the
  newer weights, yet the batch's staleness is recorded against the version it was trained with;
- policy_versions.jsonl of an earlier run in the directory is moved aside on a fresh start, as
  metrics.jsonl is;
- the run's count of engine restarts is saved with the checkpoint and counted on after a resume
  (its metric, and the rollout.max_engine_restarts limit);
- a checkpoint's prompts drawn ahead by another async mode are named, with their count, when a
  run resumes in a mode that does not take them."""

import json
from collections import deque
from types import SimpleNamespace

import pytest
import torch
from stream_fakes import Engines, Loader, RolloutGroup, check_batch, stream_trainer, train_step

from engines.rollout.config import RolloutConfig
from hybridflow.protocol import DataProto
from hybridflow.trainer.policy import Policy
from hybridflow.trainer.prompts import PromptBatches
from hybridflow.trainer.rollout.ahead import GeneratingAhead
from hybridflow.trainer.rollout.pool import PoolRollout, RolloutProcessDied
from hybridflow.trainer.rollout.stream import StreamingRollout, StreamSettings

PROBE = ([[1, 2, 3]], torch.tensor([[-1.0, -2.0]]))  # the actor's log-probs of fixed tokens


class RestartingGroup(RolloutGroup):
    """The rollout workers' side of a restart: a dead rank restarted in its slot, the transfer
    group rebuilt; the engines cannot score (as the hf engine), so the check has nothing to compare."""

    @property
    def world_size(self) -> int:
        return self.engines.ranks

    def restart_rank(self, rank: int) -> None:
        self.engines.dead.discard(rank)

    def call_rank(self, rank: int, method: str, *args):
        return None

    def leave_transfer(self) -> None:
        pass

    def start_join_transfer(self, host: str, port: int, size: int) -> None:
        pass

    def generate_sequences(self, rows: DataProto) -> DataProto:
        """A call generated at once (the modes that wait for whole batches)."""
        handle, _ = self.engines.submit(rows)
        self.engines.calls[handle]["end"] = self.engines.clock
        return self.engines.result(handle)


class SenderGroup:
    """The actor's side of a transfer and of a restart."""

    def __init__(self, group: RestartingGroup):
        self.send_weights = group.send

    def leave_transfer(self) -> None:
        pass

    def transfer_address(self) -> tuple[str, int]:
        return "127.0.0.1", 1

    def join_transfer(self, host: str, port: int, size: int) -> None:
        pass

    def probe_log_probs(self) -> list:
        return [PROBE]


def restarting_stream(tmp_path, bound: int = 2, restarts: int = 1):
    """A stream over the fake engines whose pool restarts dead processes (up to `restarts`)."""
    trainer = stream_trainer(tmp_path, bound=bound)
    group = RestartingGroup(trainer.engines)
    trainer.policy = Policy(SenderGroup(group))
    pool = PoolRollout(group, str(tmp_path), RolloutConfig(max_engine_restarts=restarts))
    settings = StreamSettings(2, 4, bound, "drop", pad_token_id=0)
    trainer.rollout = StreamingRollout(
        pool, trainer.engines, settings, clock=lambda: float(trainer.engines.clock)
    )
    return trainer


def versions_lines(tmp_path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "policy_versions.jsonl").read_text().splitlines()]


def step_killed_while_training(trainer, rank: int) -> tuple[DataProto, dict]:
    """`train_step`, with the rollout process of `rank` killed while the step trains: the stream
    meets the death when its metrics collect the calls finished meanwhile."""
    trainer.global_step += 1
    trainer.rollout.sync_weights(trainer.policy)
    from hybridflow.trainer.ppo_trainer import PPOTrainer

    batch = PPOTrainer.generate(trainer, {})
    trainer.engines.clock += 10
    trainer.engines.kill(rank)
    trainer.policy.version += 1
    return batch, trainer.rollout.metrics(batch)


def test_a_restart_met_by_the_steps_metrics_records_the_version_the_batch_was_trained_with(tmp_path):
    """max_staleness 2, a process killed after step 2: step 3's batch is trained with version 2 and
    recorded so, though the restart in its metrics sent version 3 to the engines already."""
    trainer = restarting_stream(tmp_path, bound=2)
    for _ in range(2):
        train_step(trainer)
    batch, metrics = step_killed_while_training(trainer, rank=1)
    assert metrics["rollout/engine_restarts"] == 1  # met here, in the metrics
    assert trainer.rollout.pool.served == 3  # the restart sent the newest weights
    check_batch(batch, trained_on=2, bound=2)
    last = versions_lines(tmp_path)[-1]
    assert last["trained_on"] == 2
    assert all(0 <= last["trained_on"] - s <= 2 for s in last["sample_versions"]), last
    assert metrics["async/staleness_max"] <= 2
    for _ in range(3):  # the run goes on within the bound
        check_batch(train_step(trainer)[0], trainer.policy.version - 1, 2)
    lines = versions_lines(tmp_path)
    assert [line["trained_on"] for line in lines] == [0, 1, 2, 3, 4, 5]
    assert all(0 <= line["trained_on"] - s <= 2 for line in lines for s in line["sample_versions"])


def test_a_fresh_start_moves_an_earlier_runs_policy_versions_aside(tmp_path, capsys):
    earlier = '{"trained_on": 7, "sample_versions": [5, 5]}\n'
    (tmp_path / "policy_versions.jsonl").write_text(earlier)
    trainer = stream_trainer(tmp_path)
    for _ in range(2):
        train_step(trainer)
    assert [line["trained_on"] for line in versions_lines(tmp_path)] == [0, 1]
    assert (tmp_path / "policy_versions.jsonl.1").read_text() == earlier
    assert (
        "fresh start: moved the earlier policy_versions.jsonl to policy_versions.jsonl.1"
        in capsys.readouterr().out
    )


def test_the_engine_restart_count_survives_a_resume(tmp_path):
    """Counted on from the checkpoint: the metric, and the limit (1 restart: the next death ends
    the run)."""
    trainer = restarting_stream(tmp_path / "run", restarts=1)
    (tmp_path / "run").mkdir()
    train_step(trainer)
    trainer.engines.kill(1)
    assert train_step(trainer)[1]["rollout/engine_restarts"] == 1
    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    trainer.rollout.save(str(checkpoint))
    resumed = restarting_stream(tmp_path / "run", restarts=1)
    resumed.prompts = PromptBatches(trainer.prompts.loader, 2, with_rows=False)
    resumed.rollout.load(str(checkpoint))
    resumed.policy.version = resumed.global_step = 2
    assert train_step(resumed)[1]["rollout/engine_restarts"] == 1
    resumed.engines.kill(0)
    with pytest.raises(RolloutProcessDied, match=r"1 restart\(s\) before, rollout.max_engine_restarts=1"):
        for _ in range(3):
            train_step(resumed)


def ahead_checkpoint(tmp_path) -> tuple[str, int]:
    """A one_step run's checkpoint after 2 steps (a batch drawn ahead, generated); its prompts."""
    engines = Engines()
    group = RestartingGroup(engines)
    pool = PoolRollout(group, str(tmp_path), RolloutConfig(max_engine_restarts=0))
    prompts = PromptBatches(Loader(), 2, with_rows=False)
    rollout = GeneratingAhead(pool, 1, prompts)
    policy = Policy(SimpleNamespace(send_weights=group.send))
    pool.launch = lambda rows: pool.generate(rows)  # a launch that finished at once
    for _ in range(2):
        rollout.sync_weights(policy)
        rollout.responses(prompts, steps_left=10)
        policy.version += 1
    checkpoint = tmp_path / "ahead_checkpoint"
    checkpoint.mkdir()
    rollout.save(str(checkpoint))
    return str(checkpoint), sum(len(step.batch) for step in prompts.ahead)


def test_a_stream_resumed_from_a_one_step_checkpoint_names_the_prompts_it_does_not_take(tmp_path, capsys):
    checkpoint, drawn = ahead_checkpoint(tmp_path)
    assert drawn == 4
    stream = stream_trainer(tmp_path / "stream")
    stream.rollout.load(checkpoint)
    out = capsys.readouterr().out
    assert (
        "warning: the checkpoint holds 4 prompts drawn ahead by trainer.async_training.mode one_step / async"
        in out
    )
    assert "not trained" in out


def test_a_one_step_run_resumed_from_a_stream_checkpoint_names_the_groups_it_does_not_take(tmp_path, capsys):
    trainer = stream_trainer(tmp_path)
    for _ in range(2):
        train_step(trainer)
    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    trainer.rollout.save(str(checkpoint))
    rollout = trainer.rollout
    held = len(rollout.finished) + len(rollout.in_flight) + len(rollout.unsent)
    assert held > 0
    group = RestartingGroup(Engines())
    ahead = GeneratingAhead(PoolRollout(group, str(tmp_path / "ahead")), 1, PromptBatches(Loader(), 2, False))
    ahead.load(str(checkpoint))
    assert not ahead.pending and ahead.prompts.ahead == deque()
    out = capsys.readouterr().out
    assert (
        f"warning: the checkpoint holds {held} prompts drawn ahead by trainer.async_training.mode stream"
        in out
    )


def test_a_colocated_run_resumed_from_a_one_step_checkpoint_names_the_prompts_it_does_not_take(
    tmp_path, capsys
):
    from hybridflow.trainer.rollout.colocated import ColocatedRollout

    checkpoint, drawn = ahead_checkpoint(tmp_path)
    ColocatedRollout(SimpleNamespace(load_rollout_state=lambda path: None)).load(checkpoint)
    mode = "trainer.async_training.mode one_step / async"
    assert f"warning: the checkpoint holds {drawn} prompts drawn ahead by {mode}" in capsys.readouterr().out
