"""DAPO's dynamic sampling while generating ahead (one_step, async), against a fake rollout pool,
through the driver's `collect_varied_groups`: a step's refill rounds
take the next launched batches in the loader's order (each launched again behind them, with the
step's weights), so every trained sample stays within the staleness bound and carries the version
that generated it; the step's work begins when its first batch arrives, whatever the refills add.

Each loader batch asks PROMPTS problems 100 i .. 100 i + PROMPTS - 1; an even problem's responses all
score 0 (a group without reward variance, dropped), an odd one's score 0, 1, ... (kept), so every
round keeps PROMPTS / 2 groups and a step of PROMPTS groups takes two rounds."""

import itertools
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from hybridflow.protocol import DataProto
from hybridflow.trainer.dynamic_sampling import collect_varied_groups
from hybridflow.trainer.prompts import PromptBatches
from hybridflow.trainer.rollout import ahead
from hybridflow.trainer.rollout.ahead import GeneratingAhead

PROMPTS, N, STEPS, WIDTH = 4, 2, 5, 3


class FakePool:
    """Generation serves the weights of the last sync and stamps every sample with their version;
    a launched generation is finished at once (its DataProto stands for the future)."""

    def __init__(self):
        self.served = 0
        self.launches: list[int] = []  # the version each launched batch was generated with

    def sync_weights(self, policy, every: int = 1) -> None:
        self.served = policy.version

    def generate(self, rows: DataProto) -> DataProto:
        b = len(rows)
        window = torch.zeros(b, 2, dtype=torch.float64)  # (B, 2)
        responses = rows.batch["input_ids"][:, :1].clone()  # (B, 1): the problem the row asks
        versions = torch.full((b,), self.served)  # (B,)
        return DataProto.from_dict(
            {"responses": responses, "policy_version": versions, "generation_window": window}
        )

    def launch(self, rows: DataProto) -> DataProto:
        self.launches.append(self.served)
        return self.generate(rows)

    def collect(self, launched: DataProto) -> DataProto:
        return launched

    def metrics(self, batch: DataProto) -> dict[str, float]:
        return {}


class FakeLoader:
    def __init__(self):
        self.batches = 0

    def next_batch(self) -> dict:
        problems = torch.arange(PROMPTS) + 100 * self.batches
        self.batches += 1
        ids = problems[:, None].repeat(1, WIDTH)  # (P, WIDTH)
        return {
            "input_ids": ids,
            "attention_mask": torch.ones_like(ids),
            "position_ids": torch.arange(WIDTH).repeat(PROMPTS, 1),
            "ground_truth": np.array([str(p) for p in problems.tolist()], dtype=object),
        }


def scored_round(rollout: GeneratingAhead, prompts: PromptBatches, steps_left: int) -> DataProto:
    """The rollout's next batch as the driver scores it (PPOTrainer.generate_and_score), one row per
    response: `token_level_scores` (B, 1) 0 for an even problem's responses, the response's index in
    its group for an odd one's."""
    step, responses = rollout.responses(prompts, steps_left)
    batch = step.batch.repeat(N, interleave=True).union(responses)
    problems = batch.batch["responses"][:, 0]  # (B,)
    index_in_group = torch.arange(len(batch)) % N  # (B,): rows of a group are adjacent
    scores = torch.where(problems % 2 == 1, index_in_group, 0).float()  # (B,)
    batch.batch["token_level_scores"] = scores[:, None]
    batch.batch["prompts"] = problems[:, None].repeat(1, WIDTH)  # (B, WIDTH)
    return batch


class Clock:
    """ahead's wall clock: 1, 2, 3, ... one a call."""

    def __init__(self):
        self.ticks = itertools.count(1)

    def time(self) -> float:
        return float(next(self.ticks))


@pytest.mark.parametrize("depth", [1, 2], ids=["one_step", "async-2"])
def test_refill_rounds_take_the_launched_batches_in_order_within_the_staleness_bound(depth, monkeypatch):
    clock = Clock()
    monkeypatch.setattr(ahead, "time", clock)
    prompts = PromptBatches(FakeLoader(), N, with_rows=False)
    pool = FakePool()
    rollout = GeneratingAhead(pool, depth, prompts)
    policy = SimpleNamespace(version=0)
    for k in range(1, STEPS + 1):
        rollout.sync_weights(policy)
        first = scored_round(rollout, prompts, STEPS - k)
        arrived = rollout.step_start
        batch, metrics = collect_varied_groups(
            first, lambda k=k: scored_round(rollout, prompts, STEPS - k), PROMPTS, N, 4, pad_token_id=0
        )
        # two rounds of the loader's batches 2 (k - 1) and 2 k - 1: their odd problems, in order
        odd = [100 * b + p for b in (2 * k - 2, 2 * k - 1) for p in range(1, PROMPTS, 2)]
        assert batch.batch["responses"][:, 0].tolist() == [p for p in odd for _ in range(N)], f"step {k}"
        assert list(batch.non_tensor_batch["ground_truth"]) == [str(p) for p in odd for _ in range(N)]
        assert metrics == {
            "dynamic_sampling/gen_batches": 2.0,
            "dynamic_sampling/generated_groups": 2.0 * PROMPTS,
            "dynamic_sampling/dropped_groups": float(PROMPTS),
            "dynamic_sampling/dropped_group_share": 0.5,
        }
        # each round was launched `depth` batches before it, with the weights served then
        stale = {policy.version - v for v in batch.batch["policy_version"].tolist()}
        assert max(stale) <= depth and (k == 1 or stale != {0}), f"step {k}: staleness {stale}"
        # the pipeline stays full: `depth` batches in flight (none past the last step's need)
        assert len(rollout.pending) == min(depth, STEPS - k)
        rollout.metrics(batch)
        assert rollout.work_windows[-1][0] == arrived  # the step's work began with its first batch
        policy.version += 1  # the update
    assert pool.launches == sorted(pool.launches)  # launched in order, each with the newest weights
