"""GSM8K preparation (the real jsonl through scripts/prepare_gsm8k.py), the prompt dataset and the
resumable dataloader."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from shared_data import gsm8k_dir

from hybridflow.data.dataloader import ResumableDataLoader
from hybridflow.data.gsm8k import INSTRUCTION, ground_truth_from_answer
from hybridflow.data.prompt_dataset import PromptDataset, collate_prompts, tokenize_chat
from hybridflow.utils.tiny_model import build_tokenizer

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def gsm8k_parquet(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("gsm8k")
    subprocess.run(
        [sys.executable, ROOT / "scripts/prepare_gsm8k.py", "--local_dir", gsm8k_dir(), "--out", out],
        check=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    return out


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def test_prepare_gsm8k_writes_every_row_with_the_reward_fields(gsm8k_parquet):
    test_rows = pq.read_table(gsm8k_parquet / "test.parquet").to_pylist()
    assert len(test_rows) == 1319
    assert pq.read_table(gsm8k_parquet / "train.parquet").num_rows == 7473
    first = test_rows[0]
    assert first["data_source"] == "openai/gsm8k"
    assert first["ability"] == "math"
    assert first["prompt"][0]["role"] == "user"
    assert first["prompt"][0]["content"].startswith("Janet’s ducks lay 16 eggs per day.")
    assert first["prompt"][0]["content"].endswith(INSTRUCTION)
    assert first["reward_model"]["ground_truth"] == "18"  # "#### 18" in GSM8K's test.jsonl line 1
    assert first["extra_info"] == {
        "split": "test",
        "index": 0,
        "question": first["extra_info"]["question"],
        "answer": first["extra_info"]["answer"],
    }


def test_ground_truth_drops_thousands_commas_and_requires_the_marker():
    assert ground_truth_from_answer("so 1,200 in all\n#### 1,200") == "1200"
    with pytest.raises(ValueError, match="####"):
        ground_truth_from_answer("the answer is 5")


def test_dataset_applies_the_chat_template_and_drops_long_prompts(gsm8k_parquet, tokenizer):
    files = [str(gsm8k_parquet / "test.parquet")]
    full = PromptDataset(files, tokenizer, max_prompt_length=10_000, max_samples=64)
    lengths = [len(ids) for ids in full.token_ids]
    limit = sorted(lengths)[40]
    short = PromptDataset(files, tokenizer, max_prompt_length=limit, max_samples=64)
    assert full.num_dropped == 0
    assert short.num_dropped == sum(n > limit for n in lengths) > 0
    assert len(short) == 64 - short.num_dropped
    item = full[0]
    text = "<|user|>" + item["raw_prompt"][0]["content"] + "<|assistant|>"
    assert tokenizer.decode(item["input_ids"]) == text
    assert item["reward_model"]["ground_truth"] == "18"


def test_dataset_names_the_missing_column(tmp_path, gsm8k_parquet, tokenizer):
    with pytest.raises(ValueError, match="question"):
        PromptDataset([str(gsm8k_parquet / "test.parquet")], tokenizer, 512, prompt_key="question")
    with pytest.raises(FileNotFoundError, match=r"nope\.parquet"):
        PromptDataset([str(tmp_path / "nope.parquet")], tokenizer, 512)


def test_collate_left_pads_and_positions_start_at_the_first_real_token(tokenizer):
    messages = [[{"role": "user", "content": "hi"}], [{"role": "user", "content": "a longer one"}]]
    items = [
        {
            "input_ids": torch.tensor(tokenize_chat(tokenizer, m)),
            "data_source": "s",
            "reward_model": {},
            "raw_prompt": m,
            "ability": "",
            "extra_info": {},
            "index": i,
        }
        for i, m in enumerate(messages)
    ]
    batch = collate_prompts(items, pad_token_id=tokenizer.pad_token_id)
    short, long = (len(item["input_ids"]) for item in items)
    assert batch["input_ids"].shape == (2, long)
    assert batch["attention_mask"][0].tolist() == [0] * (long - short) + [1] * short
    assert batch["input_ids"][0, : long - short].eq(tokenizer.pad_token_id).all()
    assert batch["position_ids"][0].tolist() == [0] * (long - short) + list(range(short))
    assert batch["raw_prompt"].shape == (2,) and batch["raw_prompt"][1] == messages[1]


class Numbers(torch.utils.data.Dataset):
    def __len__(self):
        return 10

    def __getitem__(self, i):
        return i


def _loader(seed=3):
    return ResumableDataLoader(Numbers(), batch_size=3, collate_fn=list, shuffle=True, seed=seed)


def test_dataloader_is_seeded_drops_the_last_partial_batch_and_reshuffles_per_epoch():
    first, again = _loader(), _loader()
    epoch0 = list(first)
    assert epoch0 == list(again)
    assert len(epoch0) == 3 and all(len(b) == 3 for b in epoch0)
    assert len(set(np.concatenate(epoch0))) == 9
    epoch1 = list(first)
    assert epoch1 != epoch0
    assert list(_loader(seed=4)) != epoch0


def test_dataloader_resumes_where_its_state_says():
    uninterrupted = _loader()
    expected = list(uninterrupted) + list(uninterrupted)
    interrupted = _loader()
    it = iter(interrupted)
    seen = [next(it), next(it)]
    state = interrupted.state_dict()
    resumed = _loader()
    resumed.load_state_dict(state)
    seen += list(resumed) + list(resumed)
    assert seen == expected
    with pytest.raises(ValueError, match=r"data\.seed"):
        _loader(seed=5).load_state_dict(state)
