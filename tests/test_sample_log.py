"""trainer.save_samples: each trained step's samples as JSON lines (hybridflow/trainer/samples.py),
read back from a batch laid out as the rollout gives it (left-padded prompts, responses with a
masked tool output), the values worked out by hand."""

import json

import numpy as np
import pytest
import torch

from hybridflow.protocol import DataProto
from hybridflow.trainer.samples import SampleLog, sample_records
from hybridflow.utils.tiny_model import build_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def trained_batch(tokenizer) -> DataProto:
    """Two samples of one prompt, the second one padded further; its response holds a tool output
    (response_mask 0) between two sampled runs."""
    pad = tokenizer.pad_token_id
    long_prompt, short_prompt = ids(tokenizer, "What is 2+3?"), ids(tokenizer, "2+3=")
    width = len(long_prompt)
    prompts = [long_prompt, [pad] * (width - len(short_prompt)) + short_prompt]
    prompt_mask = [[1] * width, [0] * (width - len(short_prompt)) + [1] * len(short_prompt)]
    five, tool, done = ids(tokenizer, "5"), ids(tokenizer, "ok"), ids(tokenizer, "4")
    responses = [five + [pad] * (len(tool) + len(done)), done + tool + done]
    response_mask = [
        [1] * len(five) + [0] * (len(tool) + len(done)),
        [1] * len(done) + [0] * len(tool) + [1] * len(done),
    ]
    length = len(responses[0])
    scores = torch.zeros(2, length)
    scores[0, len(five) - 1], scores[1, length - 1] = 1.0, 0.25
    advantages = torch.full((2, length), 7.0)  # masked positions: never counted
    advantages[0, : len(five)] = 0.5
    advantages[1, : len(done)], advantages[1, length - len(done) :] = 1.0, -2.0
    batch = DataProto.from_dict(
        {
            "input_ids": torch.cat([torch.tensor(prompts), torch.tensor(responses)], dim=1),
            "attention_mask": torch.cat([torch.tensor(prompt_mask), torch.tensor(response_mask)], dim=1),
            "responses": torch.tensor(responses),
            "response_mask": torch.tensor(response_mask),
            "token_level_scores": scores,
            "advantages": advantages,
            "policy_version": torch.tensor([3, 2]),
        }
    )
    batch.non_tensor_batch["uid"] = np.array(["g0", "g0"], dtype=object)
    batch.non_tensor_batch["reward_model"] = np.array([{"ground_truth": "5"}] * 2, dtype=object)
    return batch


def test_each_sample_is_one_record_with_its_texts_score_advantage_and_version(tokenizer):
    done = len(ids(tokenizer, "4"))
    assert sample_records(7, trained_batch(tokenizer), tokenizer) == [
        {
            "step": 7, "prompt": "What is 2+3?", "response": "5", "score": 1.0, "advantage": 0.5,
            "uid": "g0", "ground_truth": "5", "policy_version": 3,
        },
        {
            # the padding left out of the prompt; the tool output left out of the response
            "step": 7, "prompt": "2+3=", "response": "4\n4", "score": 0.25,
            "advantage": (done * 1.0 + done * -2.0) / (2 * done),  # the sampled tokens' mean
            "uid": "g0", "ground_truth": "5", "policy_version": 2,
        },
    ]  # fmt: skip


def test_a_fresh_start_moves_an_earlier_folder_aside_and_a_resume_drops_the_steps_after_it(
    tokenizer, tmp_path
):
    batch = trained_batch(tokenizer)
    first = SampleLog(tmp_path, resumed_step=None)
    for step in (1, 2, 3):
        first.write(step, batch, tokenizer)
    assert sorted(p.name for p in (tmp_path / "samples").iterdir()) == [f"step_{k}.jsonl" for k in (1, 2, 3)]
    lines = (tmp_path / "samples" / "step_2.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == sample_records(2, batch, tokenizer)

    (tmp_path / "samples" / ".step_4.jsonl.partial").write_text('{"step": 4')  # cut short by a kill
    SampleLog(tmp_path, resumed_step=2)  # resumed from step 2's checkpoint: step 3 is trained again
    assert sorted(p.name for p in (tmp_path / "samples").iterdir()) == ["step_1.jsonl", "step_2.jsonl"]

    SampleLog(tmp_path, resumed_step=None)  # a fresh start in the same directory
    assert sorted(p.name for p in (tmp_path / "samples.1").iterdir()) == ["step_1.jsonl", "step_2.jsonl"]
    assert list((tmp_path / "samples").iterdir()) == []
