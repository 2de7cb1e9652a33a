"""Turns GSM8K records ({"question", "answer"}) into hybridflow's prompt rows.

A row is what `PromptDataset` reads from parquet and what the reward needs:
`data_source`, `prompt` (chat messages), `ability`, `reward_model.ground_truth`, `extra_info`.
`scripts/prepare_gsm8k.py` writes the rows as train/test parquet files.
"""

import json
from pathlib import Path

DATA_SOURCE = "openai/gsm8k"
INSTRUCTION = 'Reason step by step, then write the final answer as a number after "####".'


def ground_truth_from_answer(answer: str) -> str:
    """The number after the last "####" of a GSM8K reference answer, without thousands commas."""
    if "####" not in answer:
        raise ValueError(f"GSM8K answer has no '####' final-answer marker: {answer[-80:]!r}")
    return answer.rsplit("####", 1)[1].strip().replace(",", "")


def to_row(record: dict, split: str, index: int) -> dict:
    """One GSM8K record as a prompt row (the question plus the answer-format instruction)."""
    question = record["question"]
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": f"{question} {INSTRUCTION}"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": ground_truth_from_answer(record["answer"])},
        "extra_info": {"split": split, "index": index, "question": question, "answer": record["answer"]},
    }


def read_jsonl(path: Path) -> list[dict]:
    """GSM8K's original jsonl: one {"question", "answer"} object per line."""
    records = []
    with open(path) as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            record = json.loads(line)
            if not {"question", "answer"} <= record.keys():
                raise ValueError(
                    f"{path}:{line_no}: expected keys 'question' and 'answer', got {sorted(record)}"
                )
            records.append(record)
    return records
