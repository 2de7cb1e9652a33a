"""GenerationAhead against a fake rollout pool, through the trainer's own `generate`: the checks
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
from hybridflow.trainer.async_loop import GenerationAhead, overlap_seconds
from hybridflow.trainer.ppo_trainer import PPOTrainer

PROMPTS, N, STEPS = 3, 2, 6


class FakeRolloutPool:
    """The driver-side contract of `DisaggregatedActorRollout`: generation serves the newest
    weights (the actor's version, the number of updates so far) and tags every sample with it."""

    def __init__(self):
        self.version = 0

    def generate_sequences(self, prompts: DataProto) -> DataProto:
        problem = prompts.batch["input_ids"][:, :1].clone()  # (B, 1): the problem the row asks
        versions = torch.full((len(prompts),), self.version)  # (B,)
        window = torch.tensor([time.time(), time.time()], dtype=torch.float64).repeat(len(prompts), 1)
        batch = {"responses": problem, "policy_version": versions, "generation_window": window}  # (B, 2)
        return DataProto.from_dict(batch)

    generate_sequences_async = generate_sequences  # a finished DataProto stands for the future

    def update_actor(self, batch: DataProto) -> DataProto:
        self.version += 1
        return DataProto(meta_info={"metrics": {}})


def loader_batches():
    """Step i's prompts ask problems 100 i .. 100 i + PROMPTS - 1, the answer in `ground_truth`."""
    step = 0
    while True:
        problems = torch.arange(PROMPTS) + 100 * step
        ids = problems[:, None].repeat(1, 4)  # (P, 4)
        yield {
            "input_ids": ids,
            "attention_mask": torch.ones_like(ids),
            "position_ids": torch.arange(4).repeat(PROMPTS, 1),
            "ground_truth": np.array([str(p) for p in problems.tolist()], dtype=object),
        }
        step += 1


def fake_trainer(mode: str, max_staleness: int) -> SimpleNamespace:
    batches = loader_batches()
    cfg = SimpleNamespace(
        rollout=SimpleNamespace(sampling=SimpleNamespace(n=N)),
        algorithm=SimpleNamespace(adv_estimator="grpo"),
        trainer=SimpleNamespace(async_training=SimpleNamespace(mode=mode, max_staleness=max_staleness)),
    )
    trainer = SimpleNamespace(cfg=cfg, global_step=0, total_steps=STEPS, rollout_reads_rows=False)
    trainer.roles = SimpleNamespace(actor_rollout=FakeRolloutPool())
    trainer.next_batch = lambda: next(batches)
    return trainer


def validation_prompts() -> DataProto:
    ids = torch.full((2, 4), 999)
    meta = {"validate": True, "n": 1}
    return DataProto.from_dict({"input_ids": ids, "attention_mask": torch.ones_like(ids)}, meta_info=meta)


@pytest.mark.parametrize(
    ("mode", "max_staleness", "depth"), [("sync", 1, 0), ("one_step", 1, 1), ("async", 2, 2)]
)
def test_each_step_trains_on_its_own_prompts_generated_by_the_expected_version(mode, max_staleness, depth):
    trainer = fake_trainer(mode, max_staleness)
    if mode != "sync":
        GenerationAhead.attach(trainer)
    pool = trainer.roles.actor_rollout
    while trainer.global_step < STEPS:
        trainer.global_step += 1
        k = trainer.global_step
        batch = PPOTrainer.generate(trainer, DataProto.from_single_dict(trainer.next_batch()), {})
        answers = [str(p) for p in batch.batch["responses"][:, 0].tolist()]
        assert answers == list(batch.non_tensor_batch["ground_truth"]), f"step {k}: responses of other rows"
        expected_problems = [100 * (k - 1) + p for p in range(PROMPTS) for _ in range(N)]
        assert batch.batch["responses"][:, 0].tolist() == expected_problems, (
            f"step {k}: not the loader's order"
        )
        assert set(batch.batch["policy_version"].tolist()) == {max(0, k - 1 - depth)}, f"step {k}"
        if k == 3:
            launched = len(getattr(pool, "pending", ()))
            validation = pool.generate_sequences(validation_prompts())
            assert validation.batch["policy_version"].tolist() == [k - 1, k - 1]  # the newest weights
            assert len(getattr(pool, "pending", ())) == launched
        metrics = pool.update_actor(batch).meta_info["metrics"]
        if mode != "sync":
            assert 0 <= metrics["timing/gen_overlap"][0] <= metrics["timing/rollout_gen"][0], metrics


def test_overlap_seconds_by_hand():
    work = [(0.0, 2.0), (3.0, 5.0), (6.0, 7.0)]
    assert overlap_seconds((1.0, 4.0), work) == 2.0  # 1-2 and 3-4
    assert overlap_seconds((2.0, 3.0), work) == 0.0  # between two steps' work
    assert overlap_seconds((0.5, 8.0), work) == 1.5 + 2.0 + 1.0
    assert overlap_seconds((1.0, 4.0), []) == 0.0
