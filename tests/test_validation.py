"""run_validation's metrics against a rollout double: the accuracy per data source and, where the
engines stamp each response with the policy version that produced it, `val/policy_version`."""

import numpy as np
import pytest
import torch

from hybridflow.protocol import DataProto
from hybridflow.reward.manager import ENV_SCORES
from hybridflow.trainer.validation import run_validation


class StampingRollout:
    """Each call's responses scored `score` (an environment's score: no tokenizer needed), stamped
    with the versions given, one call after the other (None: no stamp, as a colocated engine)."""

    def __init__(self, versions: list[int | None], score: float = 1.0):
        self.versions, self.score = list(versions), score

    def generate(self, prompts: DataProto) -> DataProto:
        assert prompts.meta_info["validate"] is True
        rows, version = len(prompts), self.versions.pop(0)
        batch = {ENV_SCORES: torch.full((rows, 1), self.score)}  # (B, 1)
        if version is not None:
            batch["policy_version"] = torch.full((rows,), version)  # (B,)
        return DataProto.from_dict(batch)


def batches(count: int, rows: int = 2) -> list[dict]:
    ids = torch.ones(rows, 3, dtype=torch.long)  # (B, P)
    return [
        {
            "input_ids": ids,
            "attention_mask": torch.ones_like(ids),
            "position_ids": torch.arange(3).repeat(rows, 1),
            "data_source": np.array(["arith"] * rows, dtype=object),
        }
        for _ in range(count)
    ]


@pytest.mark.parametrize(("versions", "expected"), [([4, 4], 4.0), ([3, 4], 4.0), ([7], 7.0)])
def test_the_policy_version_is_the_newest_the_engines_stamped(versions, expected):
    metrics = run_validation(StampingRollout(versions), batches(len(versions)), None, reward_fn=None)
    assert metrics["val/policy_version"] == expected
    assert metrics["val/accuracy"] == metrics["val/arith/accuracy"] == 1.0


def test_without_stamps_no_policy_version_is_made_up():
    metrics = run_validation(StampingRollout([None, None], score=0.5), batches(2), None, reward_fn=None)
    assert "val/policy_version" not in metrics
    assert metrics["val/accuracy"] == 0.5
