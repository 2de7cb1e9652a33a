"""The rule reward scores the model's own tokens of a multi-turn trajectory, never its tools' output."""

import torch

from hybridflow.protocol import DataProto
from hybridflow.reward.manager import compute_rewards, sequence_scores
from hybridflow.reward.registry import rule_reward_fn
from hybridflow.utils.tiny_model import build_tokenizer


def _trajectory(tokenizer, pieces: list[tuple[str, int]], pad: int = 3) -> DataProto:
    """One row whose response is `pieces` of (text, mask) in order, then `pad` padding ids."""
    ids, mask = [], []
    for text, sampled in pieces:
        piece = tokenizer(text, add_special_tokens=False)["input_ids"]
        ids += piece
        mask += [sampled] * len(piece)
    return DataProto.from_dict(
        {"responses": torch.tensor([ids + [0] * pad]), "response_mask": torch.tensor([mask + [0] * pad])},
        {"data_source": ["openai/gsm8k"], "reward_model": [{"ground_truth": "72"}]},
    )


def test_a_tool_response_holding_the_answer_earns_no_reward():
    tokenizer = build_tokenizer()
    batch = _trajectory(tokenizer, [("let me compute", 1), ("#### 72", 0), ("done", 1)])
    scores = compute_rewards(batch, tokenizer, rule_reward_fn(format_score=0.0)).batch["token_level_scores"]
    assert scores.sum().item() == 0.0


def test_the_model_answer_after_a_tool_call_earns_the_reward():
    tokenizer = build_tokenizer()
    batch = _trajectory(tokenizer, [("let me compute", 1), ("#### 5", 0), ("so #### 72", 1)])
    scores = compute_rewards(batch, tokenizer, rule_reward_fn(format_score=0.0)).batch["token_level_scores"]
    assert scores.sum().item() == 1.0


def test_each_sampled_turn_is_decoded_on_its_own_line():
    tokenizer = build_tokenizer()
    batch = _trajectory(tokenizer, [("ab", 1), ("|tool|", 0), ("cd", 1)])
    seen = []
    sequence_scores(batch, tokenizer, lambda source, solution, truth, extra: seen.append(solution) or 1.0)
    assert seen == ["ab\ncd"]


def test_sampled_runs_split_where_the_mask_drops_to_zero():
    from hybridflow.reward.manager import sampled_runs

    ids = torch.tensor([10, 11, 12, 13, 14, 15, 16])
    assert sampled_runs(ids, torch.tensor([1, 1, 0, 1, 0, 0, 1])) == [[10, 11], [13], [16]]
    assert sampled_runs(ids, torch.tensor([0, 0, 0, 0, 0, 0, 0])) == []
    assert sampled_runs(ids, torch.tensor([1, 1, 1, 1, 1, 1, 1])) == [ids.tolist()]
