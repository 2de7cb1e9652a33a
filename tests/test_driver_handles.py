"""The policy handle and the rollout pool: the policy version counts only updates that changed the
weights, and the rollout pool receives a transfer only when the policy's version is new to it; both
through the trainer's own `update_models` and `sync_weights` (the lines of its loop), over worker
groups that stand in for Ray's (the real ones run in the recipe tests)."""

from types import SimpleNamespace

import pytest
import torch

from hybridflow.protocol import DataProto
from hybridflow.trainer.policy import Policy, update_applied
from hybridflow.trainer.ppo_trainer import PPOTrainer
from hybridflow.trainer.rollout.pool import PoolRollout


@pytest.mark.parametrize(
    ("metrics", "applied"),
    [
        ({"actor/nonfinite_skipped": [0.0, 0.0]}, True),
        ({"actor/nonfinite_skipped": [1.0, 1.0]}, False),  # every grad norm NaN
        ({"actor/nonfinite_skipped": [0.0, 0.0], "actor/update_refused": [1.0, 1.0]}, False),
        ({"actor/nonfinite_skipped": [0.0, 1.0], "actor/update_refused": [1.0]}, False),  # one of each
        ({"actor/nonfinite_skipped": [0.0, 1.0], "actor/update_refused": [0.0]}, True),  # one applied
        ({}, True),  # a worker reporting no guard
    ],
)
def test_update_applied_when_any_optimizer_step_was(metrics, applied):
    assert update_applied(metrics) is applied


class PolicyGroup:
    """The policy workers' calls the handles make: an update whose optimizer steps are refused or
    applied as told, and the sender's side of a transfer."""

    def __init__(self, rollout_group):
        self.rollout_group = rollout_group
        self.refuse = False

    def update_actor(self, batch: DataProto) -> DataProto:
        skipped = [1.0, 1.0] if self.refuse else [0.0, 0.0]
        return DataProto(
            meta_info={"metrics": {"actor/nonfinite_skipped": skipped, "actor/pg_loss": [0.1, 0.2]}}
        )

    def send_weights(self, version: int) -> None:
        self.rollout_group.sent.append(version)


class RolloutGroup:
    """The rollout pool's side of a transfer: the engines serve the version last sent."""

    def __init__(self):
        self.sent: list[int] = []

    def start_receive_weights(self) -> None:
        pass

    def finish_transfer(self) -> list[int]:
        return [self.sent[-1]]


def trainer_over(tmp_path) -> tuple[PPOTrainer, PolicyGroup, RolloutGroup]:
    rollout_group = RolloutGroup()
    policy_group = PolicyGroup(rollout_group)
    trainer = object.__new__(PPOTrainer)  # the loop's methods, without a tokenizer or data
    trainer.cfg = SimpleNamespace(critic=SimpleNamespace(warmup_steps=0))
    trainer.policy, trainer.critic, trainer.global_step = Policy(policy_group), None, 1
    trainer.rollout = PoolRollout(rollout_group, str(tmp_path))
    return trainer, policy_group, rollout_group


def test_a_refused_update_moves_no_weights_and_leaves_the_version(tmp_path):
    trainer, policy_group, rollout_group = trainer_over(tmp_path)
    timings = {}
    trainer.sync_weights(timings)
    assert rollout_group.sent == [0] and "weight_sync" in timings
    policy_group.refuse = True
    assert trainer.update_models(DataProto(), timings)["actor/pg_loss"] == pytest.approx(0.15)
    trainer.sync_weights(timings)
    assert trainer.policy.version == 0 and rollout_group.sent == [0]  # nothing changed, nothing sent
    policy_group.refuse = False
    trainer.update_models(DataProto(), timings)
    trainer.sync_weights(timings)
    assert trainer.policy.version == 1 and rollout_group.sent == [0, 1]


def test_staleness_is_counted_against_the_version_served_since_the_last_sync(tmp_path):
    trainer, policy_group, _ = trainer_over(tmp_path)
    trainer.sync_weights({})
    policy_group.refuse = True
    trainer.update_models(DataProto(), {})  # refused: still version 0
    trainer.sync_weights({})
    batch = DataProto.from_dict({"policy_version": torch.tensor([0, 0])})
    assert trainer.rollout.metrics(batch)["async/staleness_max"] == 0.0
