"""GeneratingAhead against a fake rollout pool, through the trainer's own `generate`: the checks
behind docs/async.md's "is it a defect?" answer, at unit level.

For every step of a run, in sync, one_step and async (max_staleness 2): the responses the step
trains on were generated for the very rows it scores (each fake response names the problem it
answers, so a shift between prompts / ground truth and responses shows), with the weights of
version max(0, k - 1 - depth) (the pool serves the newest weights when a generation is launched),
the prompts come in the loader's order (the synchronous loop's data), and validation in the
middle of a run generates with the newest weights and leaves the launched generations alone.
Each update reports the overlap of its batch's generation with the driver's earlier work.
"""

import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from hybridflow.protocol import DataProto
from hybridflow.trainer.ppo_trainer import PPOTrainer
from hybridflow.trainer.prompts import PromptBatches, StepPrompts
from hybridflow.trainer.rollout.ahead import GeneratingAhead, overlap_seconds
from hybridflow.trainer.rollout.pool import sync_due

PROMPTS, N, STEPS = 3, 2, 6


class FakeRolloutPool:
    """The driver-side contract of `PoolRollout`: generation serves the weights of the last sync
    (the policy's version, the number of updates so far) and tags every sample with it."""

    def __init__(self):
        self.served = None
        self.policy = None

    def sync_weights(self, policy, every: int = 1) -> None:
        self.policy = policy
        if sync_due(self.served, policy.version, every):
            self.served = policy.version

    def newest_weights(self) -> None:
        self.served = self.policy.version

    def generate(self, rows: DataProto) -> DataProto:
        problem = rows.batch["input_ids"][:, :1].clone()  # (B, 1): the problem the row asks
        versions = torch.full((len(rows),), self.served)  # (B,)
        window = torch.tensor([time.time(), time.time()], dtype=torch.float64).repeat(len(rows), 1)
        batch = {"responses": problem, "policy_version": versions, "generation_window": window}  # (B, 2)
        return DataProto.from_dict(batch)

    launch = generate  # a finished DataProto stands for the future

    def collect(self, launched: DataProto) -> DataProto:
        return launched

    def responses(self, prompts: PromptBatches, steps_left: int) -> tuple[StepPrompts, DataProto]:
        step = prompts.next()
        return step, self.generate(step.rows)

    def metrics(self, batch: DataProto) -> dict[str, float]:
        return {}


class FakeLoader:
    """Step i's prompts ask problems 100 i .. 100 i + PROMPTS - 1, the answer in `ground_truth`."""

    def __init__(self):
        self.step = 0

    def next_batch(self) -> dict:
        problems = torch.arange(PROMPTS) + 100 * self.step
        self.step += 1
        ids = problems[:, None].repeat(1, 4)  # (P, 4)
        return {
            "input_ids": ids,
            "attention_mask": torch.ones_like(ids),
            "position_ids": torch.arange(4).repeat(PROMPTS, 1),
            "ground_truth": np.array([str(p) for p in problems.tolist()], dtype=object),
        }


def fake_trainer(depth: int) -> SimpleNamespace:
    cfg = SimpleNamespace(
        rollout=SimpleNamespace(sampling=SimpleNamespace(n=N)),
        algorithm=SimpleNamespace(adv_estimator="grpo"),
    )
    prompts = PromptBatches(FakeLoader(), N, with_rows=False)
    rollout = FakeRolloutPool()
    if depth > 0:
        rollout = GeneratingAhead(rollout, depth, prompts)
    policy = SimpleNamespace(version=0)
    return SimpleNamespace(
        cfg=cfg, global_step=0, total_steps=STEPS, prompts=prompts, rollout=rollout, policy=policy
    )


def validation_prompts() -> DataProto:
    ids = torch.full((2, 4), 999)
    meta = {"validate": True, "n": 1}
    return DataProto.from_dict({"input_ids": ids, "attention_mask": torch.ones_like(ids)}, meta_info=meta)


@pytest.mark.parametrize("depth", [0, 1, 2], ids=["sync", "one_step", "async-2"])
def test_each_step_trains_on_its_own_prompts_generated_by_the_expected_version(depth):
    trainer = fake_trainer(depth)
    rollout = trainer.rollout
    while trainer.global_step < STEPS:
        trainer.global_step += 1
        k = trainer.global_step
        rollout.sync_weights(trainer.policy)
        batch = PPOTrainer.generate(trainer, {})
        answers = [str(p) for p in batch.batch["responses"][:, 0].tolist()]
        assert answers == list(batch.non_tensor_batch["ground_truth"]), f"step {k}: responses of other rows"
        expected_problems = [100 * (k - 1) + p for p in range(PROMPTS) for _ in range(N)]
        assert batch.batch["responses"][:, 0].tolist() == expected_problems, (
            f"step {k}: not the loader's order"
        )
        assert set(batch.batch["policy_version"].tolist()) == {max(0, k - 1 - depth)}, f"step {k}"
        if k == 3:
            launched = len(getattr(rollout, "pending", ()))
            validation = rollout.generate(validation_prompts())
            assert validation.batch["policy_version"].tolist() == [k - 1, k - 1]  # the newest weights
            assert len(getattr(rollout, "pending", ())) == launched
        trainer.policy.version += 1  # the update
        metrics = rollout.metrics(batch)
        if depth > 0:
            assert 0 <= metrics["timing/gen_overlap"] <= metrics["timing/rollout_gen"], metrics


def test_overlap_seconds_by_hand():
    work = [(0.0, 2.0), (3.0, 5.0), (6.0, 7.0)]
    assert overlap_seconds((1.0, 4.0), work) == 2.0  # 1-2 and 3-4
    assert overlap_seconds((2.0, 3.0), work) == 0.0  # between two steps' work
    assert overlap_seconds((0.5, 8.0), work) == 1.5 + 2.0 + 1.0
    assert overlap_seconds((1.0, 4.0), []) == 0.0
