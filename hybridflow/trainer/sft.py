"""Supervised warm start (`trainer.mode: sft`) on the same Megatron actor and rollout as RL.

Each step is one optimizer step of token-mean cross-entropy on the response tokens of a batch of
(prompt, reference answer) rows (`actor_rollout.train_sft`). Validation is the RL validation
(greedy generation through the rollout engine, scored by the rule reward), and with
`trainer.export_hf: true` the result is written to <output_dir>/hf for an RL run to start from:

    bash scripts/run_recipe.sh recipes/quickstart_sft.yaml

The prompt is the row's chat `prompt` (rendered with the chat template, as RL renders it) and
the answer is the row's `extra_info.answer` (what GSM8K and arith rows carry), followed by EOS.
Checkpoints, resume, metrics and plots are the RL trainer's.
"""

import logging

import torch

from hybridflow.data.dataloader import ResumableDataLoader
from hybridflow.data.prompt_dataset import read_parquet_rows, tokenize_chat
from hybridflow.protocol import DataProto
from hybridflow.trainer import metrics
from hybridflow.trainer.ppo_trainer import PPOTrainer

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
                 prompt_key: str = "prompt", max_samples: int | None = None):  # fmt: skip
        rows = read_parquet_rows(files, (prompt_key, "extra_info"))
        if max_samples is not None:
            rows = rows[:max_samples]
        self.pairs = []
        for row in rows:
            prompt = tokenize_chat(tokenizer, row[prompt_key])
            response = tokenizer(answer_of(row), add_special_tokens=False)["input_ids"] + [
                tokenizer.eos_token_id
            ]
            if len(prompt) <= max_prompt_length and len(response) <= max_response_length:
                self.pairs.append((prompt, response))
        self.num_dropped = len(rows) - len(self.pairs)
        if self.num_dropped:
            logger.warning(
                "dropped %d of %d SFT rows from %s: prompt over data.max_prompt_length=%d or answer over "
                "rollout.response_length=%d tokens",
                self.num_dropped, len(rows), files, max_prompt_length, max_response_length,
            )  # fmt: skip
        if not self.pairs:
            raise ValueError(
                f"every SFT row in {files} exceeds data.max_prompt_length={max_prompt_length} or "
                f"rollout.response_length={max_response_length}; raise them"
            )

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, i: int) -> tuple[list[int], list[int]]:
        return self.pairs[i]


def collate_sft(pairs: list[tuple[list[int], list[int]]], pad_token_id: int) -> dict[str, torch.Tensor]:
    """A rollout-shaped batch: prompts left-padded to P, responses right-padded to R.

    input_ids / attention_mask / position_ids (B, P+R); responses / response_mask (B, R)."""
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
    return {
        "input_ids": torch.cat([prompts, responses], dim=1),  # (B, P+R)
        "attention_mask": attention_mask,
        "position_ids": (attention_mask.cumsum(dim=1) - 1).clamp(min=0),  # (B, P+R)
        "responses": responses,
        "response_mask": response_mask,
    }


class SFTTrainer(PPOTrainer):
    """The RL trainer's loop, checkpoints and validation with a supervised step in place of the
    RL dataflow. Batch size is data.train_batch_size rows; lr and micro-batches are the actor's."""

    def _loader(self, files: list[str], max_samples: int | None, train: bool = False) -> ResumableDataLoader:
        if not train:  # validation prompts: greedy generation, as in RL
            return super()._loader(files, max_samples, train=False)
        data = self.cfg.data
        dataset = SFTDataset(
            files, self.tokenizer, data.max_prompt_length, self.cfg.rollout.response_length,
            data.prompt_key, max_samples,
        )  # fmt: skip
        return ResumableDataLoader(
            dataset,
            data.train_batch_size,
            collate_fn=lambda pairs: collate_sft(pairs, self.tokenizer.pad_token_id),
            shuffle=data.shuffle,
            seed=data.seed,
        )

    def step(self, batch_dict: dict) -> dict[str, float]:
        """One supervised optimizer step; returns sft/loss, sft/grad_norm, sft/lr and timings."""
        timings = {}
        with metrics.timer("step", timings):
            batch = DataProto.from_single_dict(batch_dict)
            out = metrics.mean_worker_metrics(self.roles.actor_rollout.train_sft(batch))
        tokens = batch.batch["response_mask"].sum().item()
        return {
            **out,
            "sft/response_tokens": tokens,
            **metrics.timing_metrics(timings),
            **metrics.throughput(batch, timings["step"]),
        }
