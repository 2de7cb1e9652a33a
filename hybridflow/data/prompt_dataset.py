"""Prompt rows from parquet, tokenized with the model's chat template, batched left-padded.

Each parquet row has `prompt` (chat messages), `data_source`, `reward_model` ({"ground_truth"}),
and optionally `ability` and `extra_info` (the rows `scripts/prepare_gsm8k.py` writes). Prompts
longer than `max_prompt_length` tokens are dropped when the dataset is built, and the count is
reported, so a batch never carries a truncated question.
"""

import logging
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from hybridflow.agents.template import tokenize_chat
from hybridflow.data.image_prompts import IMAGES_KEY, decode_images, image_prompt_inputs
from hybridflow.protocol import PIXEL_VALUES_KEY

logger = logging.getLogger(__name__)

REQUIRED_COLUMNS = ("data_source", "reward_model")
NON_TENSOR_KEYS = ("data_source", "reward_model", "raw_prompt", "ability", "extra_info", "index")


def read_parquet_rows(files: list[str], required: tuple[str, ...]) -> list[dict]:
    """All rows of `files`, in order; each file must be parquet with the `required` columns."""
    return [row for _, row in read_located_rows(files, required)]


def read_located_rows(files: list[str], required: tuple[str, ...]) -> list[tuple[str, dict]]:
    """(`<file> row <i>`, row) for every row of `files`, in order, so an error can name the row."""
    located = []
    for file in files:
        if not Path(file).is_file():
            raise FileNotFoundError(f"parquet file {file} does not exist")
        try:
            table = pq.read_table(file)
        except pa.ArrowException as err:
            raise ValueError(f"{file} is not a readable parquet file ({err})") from None
        missing = [c for c in required if c not in table.column_names]
        if missing:
            raise ValueError(f"{file} lacks columns {missing}; it has {table.column_names}")
        located += [(f"{file} row {i}", row) for i, row in enumerate(table.to_pylist())]
    return located


def check_chat_prompt(messages, where: str, prompt_key: str = "prompt") -> None:
    """ValueError naming the row unless `messages` is a non-empty list of {role, content} dicts
    with string values (what the chat template renders)."""
    expected = "expected a non-empty list of chat messages [{'role': ..., 'content': ...}]"
    if not isinstance(messages, list | tuple) or not messages:
        raise ValueError(f"{where}: {prompt_key} is {messages!r}; {expected}")
    for message in messages:
        if not (
            isinstance(message, dict)
            and isinstance(message.get("role"), str)
            and isinstance(message.get("content"), str)
        ):
            raise ValueError(f"{where}: {prompt_key} has the message {message!r}; {expected}")


class PromptDataset(torch.utils.data.Dataset):
    """Tokenized chat prompts; `num_dropped` counts prompts over `max_prompt_length`. With a
    vision-language model's `processor`, rows also need an `images` column
    (hybridflow/data/image_prompts.py): ids are the processor's, image tokens expanded, and each
    item carries its `pixel_values`, made again when the item is read rather than held for every
    row."""

    def __init__(
        self,
        files: list[str],
        tokenizer,
        max_prompt_length: int,
        prompt_key: str = "prompt",
        max_samples: int | None = None,
        tools: list[dict] | None = None,
        processor=None,
        template_kwargs: dict | None = None,
    ):
        """`tools`: function schemas the chat template renders into every prompt (agent loops);
        `template_kwargs`: extra variables of the chat template (rollout.chat_template_kwargs)."""
        images_column = (IMAGES_KEY,) if processor is not None else ()
        located = read_located_rows(files, (prompt_key, *REQUIRED_COLUMNS, *images_column))
        if max_samples is not None:
            located = located[:max_samples]
        if not located:
            raise ValueError(f"{files} hold no rows; add prompt rows")
        self.prompt_key, self.processor, self.tools = prompt_key, processor, tools
        self.rows, self.token_ids, self.where = [], [], []
        for where, row in located:
            check_chat_prompt(row[prompt_key], where, prompt_key)
            if processor is None:
                ids = tokenize_chat(tokenizer, row[prompt_key], tools, template_kwargs)
            else:
                images = decode_images(row[IMAGES_KEY], where)
                ids, _ = image_prompt_inputs(processor, row[prompt_key], images, where, tools)
            if len(ids) <= max_prompt_length:
                self.rows.append(row)
                self.token_ids.append(ids)
                self.where.append(where)
        self.num_dropped = len(located) - len(self.rows)
        if self.num_dropped:
            logger.warning(
                "dropped %d of %d prompts from %s longer than max_prompt_length=%d tokens",
                self.num_dropped,
                len(located),
                files,
                max_prompt_length,
            )
        if not self.rows:
            raise ValueError(
                f"every prompt in {files} is longer than data.max_prompt_length={max_prompt_length}; "
                "raise data.max_prompt_length"
            )

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        row = self.rows[i]
        item = {
            "input_ids": torch.tensor(self.token_ids[i], dtype=torch.long),
            "data_source": row["data_source"],
            "reward_model": row["reward_model"],
            "raw_prompt": row[self.prompt_key],
            "ability": row.get("ability", ""),
            "extra_info": row.get("extra_info") or {},
            "index": i,
        }
        if self.processor is not None:
            images = decode_images(row[IMAGES_KEY], self.where[i])
            _, item[PIXEL_VALUES_KEY] = image_prompt_inputs(
                self.processor, row[self.prompt_key], images, self.where[i], self.tools
            )
        return item


def object_array(values: list) -> np.ndarray:
    """A 1-D object array even when the values are lists (np.array would make them a 2-D array)."""
    out = np.empty(len(values), dtype=object)
    out[:] = values
    return out


def collate_prompts(items: list[dict], pad_token_id: int) -> dict:
    """Left-pads prompts to the longest in the batch: input_ids, attention_mask, position_ids
    (B, P) plus the non-tensor columns as object arrays."""
    length = max(len(item["input_ids"]) for item in items)
    input_ids = torch.full((len(items), length), pad_token_id, dtype=torch.long)  # (B, P)
    attention_mask = torch.zeros((len(items), length), dtype=torch.long)  # (B, P)
    for row, item in enumerate(items):
        ids = item["input_ids"]
        input_ids[row, length - len(ids) :] = ids
        attention_mask[row, length - len(ids) :] = 1
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)  # (B, P)
    batch = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}
    keys = (*NON_TENSOR_KEYS, PIXEL_VALUES_KEY) if PIXEL_VALUES_KEY in items[0] else NON_TENSOR_KEYS
    batch.update({key: object_array([item[key] for item in items]) for key in keys})
    return batch
