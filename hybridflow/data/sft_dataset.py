"""The supervised warm start's data (`trainer.mode: sft`, trainer/sft.py): (prompt, reference answer)
pairs and their rollout-shaped batches.

The prompt is the row's chat `prompt` (rendered with the chat template, as RL renders it) and
the answer is the row's `extra_info.answer` (what GSM8K and arith rows carry), followed by EOS.
"""

import logging

import torch

from hybridflow.data.image_prompts import IMAGES_KEY, decode_images, image_prompt_inputs
from hybridflow.data.prompt_dataset import object_array, read_located_rows, tokenize_chat
from hybridflow.protocol import PIXEL_VALUES_KEY

logger = logging.getLogger(__name__)


def answer_of(row: dict) -> str:
    """The SFT target of a row: `extra_info.answer`."""
    answer = (row.get("extra_info") or {}).get("answer")
    if not isinstance(answer, str) or not answer:
        raise ValueError(
            f"SFT needs each row's extra_info.answer (the reference response); row {row.get('extra_info')} "
            "has none"
        )
    return answer


class SFTDataset(torch.utils.data.Dataset):
    """(prompt ids, response ids + EOS) pairs; rows whose prompt or response is longer than the
    limits are dropped and counted, like PromptDataset drops long prompts."""

    def __init__(self, files: list[str], tokenizer, max_prompt_length: int, max_response_length: int,
                 prompt_key: str = "prompt", max_samples: int | None = None, processor=None):  # fmt: skip
        """With a vision-language model's `processor`, rows also need an `images` column
        (hybridflow/data/image_prompts.py) and each item carries its pixels, made when it is read."""
        images_column = (IMAGES_KEY,) if processor is not None else ()
        located = read_located_rows(files, (prompt_key, "extra_info", *images_column))[:max_samples]
        self.processor, self.prompt_key = processor, prompt_key
        self.pairs, self.image_rows = [], []  # image_rows: (where, row) of each pair, with a processor
        for where, row in located:
            prompt = self._prompt_ids(tokenizer, row, where)
            response = tokenizer(answer_of(row), add_special_tokens=False)["input_ids"] + [
                tokenizer.eos_token_id
            ]
            if len(prompt) <= max_prompt_length and len(response) <= max_response_length:
                self.pairs.append((prompt, response))
                self.image_rows += [(where, row)] if processor is not None else []
        self.num_dropped = len(located) - len(self.pairs)
        if self.num_dropped:
            logger.warning(
                "dropped %d of %d SFT rows from %s: prompt over data.max_prompt_length=%d or answer over "
                "rollout.response_length=%d tokens",
                self.num_dropped, len(located), files, max_prompt_length, max_response_length,
            )  # fmt: skip
        if not self.pairs:
            raise ValueError(
                f"every SFT row in {files} exceeds data.max_prompt_length={max_prompt_length} or "
                f"rollout.response_length={max_response_length}; raise them"
            )

    def __len__(self) -> int:
        return len(self.pairs)

    def _prompt_ids(self, tokenizer, row: dict, where: str) -> list[int]:
        if self.processor is None:
            return tokenize_chat(tokenizer, row[self.prompt_key])
        images = decode_images(row[IMAGES_KEY], where)
        return image_prompt_inputs(self.processor, row[self.prompt_key], images, where)[0]

    def __getitem__(self, i: int) -> tuple:
        """(prompt ids, response ids), and with a processor the row's pixels (n_images, 3, H, W)."""
        if self.processor is None:
            return self.pairs[i]
        where, row = self.image_rows[i]
        images = decode_images(row[IMAGES_KEY], where)
        return (*self.pairs[i], image_prompt_inputs(self.processor, row[self.prompt_key], images, where)[1])


def collate_sft(pairs: list[tuple], pad_token_id: int) -> dict:
    """A rollout-shaped batch: prompts left-padded to P, responses right-padded to R.

    input_ids / attention_mask / position_ids (B, P+R); responses / response_mask (B, R); items with
    pixels (image prompts) add `pixel_values`, one array per row (protocol.PIXEL_VALUES_KEY)."""
    pixels = [item[2] for item in pairs] if len(pairs[0]) == 3 else None
    pairs = [item[:2] for item in pairs]
    prompt_len = max(len(p) for p, _ in pairs)
    response_len = max(len(r) for _, r in pairs)
    batch = len(pairs)
    prompts = torch.full((batch, prompt_len), pad_token_id, dtype=torch.long)  # (B, P)
    prompt_mask = torch.zeros((batch, prompt_len), dtype=torch.long)  # (B, P)
    responses = torch.full((batch, response_len), pad_token_id, dtype=torch.long)  # (B, R)
    response_mask = torch.zeros((batch, response_len), dtype=torch.long)  # (B, R)
    for row, (prompt, response) in enumerate(pairs):
        prompts[row, prompt_len - len(prompt) :] = torch.tensor(prompt)
        prompt_mask[row, prompt_len - len(prompt) :] = 1
        responses[row, : len(response)] = torch.tensor(response)
        response_mask[row, : len(response)] = 1
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)  # (B, P+R)
    images = {} if pixels is None else {PIXEL_VALUES_KEY: object_array(pixels)}
    return images | {
        "input_ids": torch.cat([prompts, responses], dim=1),  # (B, P+R)
        "attention_mask": attention_mask,
        "position_ids": (attention_mask.cumsum(dim=1) - 1).clamp(min=0),  # (B, P+R)
        "responses": responses,
        "response_mask": response_mask,
    }
