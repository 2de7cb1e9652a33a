"""DAPO dynamic sampling on the driver (Yu et al. 2025, section 3.2) over hand-made scored batches:
which groups are dropped, how rounds of different prompt widths are joined, the round limit."""

import numpy as np
import pytest
import torch

from hybridflow.protocol import DataProto
from hybridflow.trainer.dynamic_sampling import collect_varied_groups, drop_uniform_groups

PAD, R = 0, 3


def scored_round(name: str, prompt_width: int, group_scores: list[list[float]]) -> DataProto:
    """One generation round: a group per entry of `group_scores` (its responses' rewards), prompt
    ids 7 (left-padded to nothing: every prompt is `prompt_width` long), responses of 2 tokens."""
    rows = [(f"{name}{g}", score) for g, scores in enumerate(group_scores) for score in scores]
    b = len(rows)
    prompts = torch.full((b, prompt_width), 7)
    responses = torch.tensor([[5, 6, PAD]] * b)
    response_mask = torch.tensor([[1, 1, 0]] * b)
    scores = torch.zeros(b, R)
    scores[:, 1] = torch.tensor([score for _, score in rows])
    return DataProto.from_dict(
        {
            "prompts": prompts,
            "responses": responses,
            "response_mask": response_mask,
            "input_ids": torch.cat([prompts, responses], 1),
            "attention_mask": torch.cat([torch.ones(b, prompt_width, dtype=torch.long), response_mask], 1),
            "position_ids": torch.arange(prompt_width + R).repeat(b, 1),
            "token_level_scores": scores,
        },
        non_tensors={"uid": np.array([uid for uid, _ in rows], dtype=object)},
        meta_info={"round": name},
    )


def test_drop_uniform_groups_keeps_only_groups_whose_rewards_differ():
    kept, dropped = drop_uniform_groups(scored_round("a", 2, [[1.0, 1.0], [0.0, 1.0], [0.0, 0.0]]))
    assert kept.non_tensor_batch["uid"].tolist() == ["a1", "a1"]
    assert dropped == 2


def test_rounds_are_drawn_until_the_batch_is_full_and_joined_at_one_prompt_width():
    first = scored_round("a", 3, [[1.0, 1.0], [0.0, 1.0]])
    more = iter([scored_round("b", 5, [[0.0, 0.0], [1.0, 0.0], [0.5, 0.25]])])
    batch, metrics = collect_varied_groups(
        first, lambda: next(more), 3, 2, max_gen_batches=4, pad_token_id=PAD
    )
    assert batch.non_tensor_batch["uid"].tolist() == ["a1", "a1", "b1", "b1", "b2", "b2"]
    # round a's prompts are 2 shorter: left-padded with the pad id, masked, position 0
    assert batch.batch["input_ids"].shape == (6, 5 + R)
    assert batch.batch["input_ids"][0].tolist() == [PAD, PAD, 7, 7, 7, 5, 6, PAD]
    assert batch.batch["attention_mask"][0].tolist() == [0, 0, 1, 1, 1, 1, 1, 0]
    assert batch.batch["position_ids"][0, :3].tolist() == [0, 0, 0]
    assert batch.batch["prompts"][0].tolist() == [PAD, PAD, 7, 7, 7]
    assert batch.batch["token_level_scores"][:, 1].tolist() == [0.0, 1.0, 1.0, 0.0, 0.5, 0.25]
    assert batch.meta_info == {"round": "a"}
    # groups a0 and b0 dropped out of the 5 generated
    assert metrics == {
        "dynamic_sampling/gen_batches": 2.0,
        "dynamic_sampling/generated_groups": 5.0,
        "dynamic_sampling/dropped_groups": 2.0,
        "dynamic_sampling/dropped_group_share": 2 / 5,
    }


def test_surplus_groups_are_cut_whole():
    first = scored_round("a", 2, [[0.0, 1.0], [1.0, 0.0], [1.0, 1.0]])
    batch, metrics = collect_varied_groups(first, None, 1, 2, max_gen_batches=1, pad_token_id=PAD)
    assert batch.non_tensor_batch["uid"].tolist() == ["a0", "a0"]
    assert metrics["dynamic_sampling/gen_batches"] == 1.0


def test_the_round_limit_stops_with_the_setting_to_change():
    uniform = [[1.0, 1.0], [0.0, 0.0]]
    rounds = iter([scored_round("b", 2, uniform)])
    with pytest.raises(RuntimeError, match=r"found 0 of 2 .* in 2 generation rounds .*max_num_gen_batches=2"):
        collect_varied_groups(scored_round("a", 2, uniform), lambda: next(rounds), 2, 2, 2, PAD)
