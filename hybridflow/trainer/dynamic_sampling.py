"""DAPO's dynamic sampling on the driver (Yu et al. 2025, arXiv:2503.14476, section 3.2): prompt
groups whose responses all got the same reward carry no group-relative signal, so they are dropped
and more prompts are generated and scored until the step has `data.train_batch_size` groups with
reward variance, at most `algorithm.filter_groups.max_num_gen_batches` generation rounds per step.

A round is the rollout's next batch, whatever the mode (`rollout.responses`): generated now (sync),
the next batch launched ahead, with another launched behind it (one_step, async), or the stream's
next finished groups within the staleness bound (stream). Each round's samples keep the policy
version that generated them, so the staleness bound and the version stamps hold as in any step.

Rows of a group are adjacent (the driver repeats each prompt n times in place) and stay in order,
so the first `groups_needed * n` kept rows are whole groups; surplus groups are discarded.
"""

from collections.abc import Callable

import torch

from hybridflow.algorithms import groups_with_reward_variance
from hybridflow.protocol import DataProto

# (B, P + R) / (B, P) tensors whose prompt part is left-padded, and the value their padding holds
# (None: the tokenizer's pad id). Prompts of different rounds differ in width P.
PROMPT_SIDE = {"prompts": None, "input_ids": None, "attention_mask": 0, "position_ids": 0}


def drop_uniform_groups(batch: DataProto) -> tuple[DataProto, int]:
    """The rows of `batch` whose group (`uid`) has reward variance, and how many groups were dropped.
    The reward of a response is the sum of its `token_level_scores`."""
    uids = batch.non_tensor_batch["uid"]
    keep = groups_with_reward_variance(batch.batch["token_level_scores"].sum(-1), uids)  # (B,)
    dropped = len(set(uids[~keep.numpy()]))
    return batch[keep], dropped


def left_pad_prompts(batch: DataProto, prompt_width: int, pad_token_id: int) -> DataProto:
    """`batch` with the prompt part of its prompt-side tensors left-padded to `prompt_width`."""
    extra = prompt_width - batch.batch["prompts"].size(1)
    if extra == 0:
        return batch
    padded = dict(batch.batch.items())
    for key, value in PROMPT_SIDE.items():
        if key in padded:
            fill = pad_token_id if value is None else value
            padded[key] = torch.nn.functional.pad(padded[key], (extra, 0), value=fill)  # (B, W + extra)
    return DataProto.from_dict(padded, non_tensors=batch.non_tensor_batch, meta_info=batch.meta_info)


def concat_rounds(parts: list[DataProto], pad_token_id: int) -> DataProto:
    """One batch from several generation rounds (prompt widths evened out; the first round's meta_info)."""
    width = max(part.batch["prompts"].size(1) for part in parts)
    padded = [left_pad_prompts(part, width, pad_token_id) for part in parts]
    meta_info = dict(parts[0].meta_info)
    for part in padded:
        part.meta_info = {}
    merged = DataProto.concat(padded)
    merged.meta_info = meta_info
    return merged


def collect_varied_groups(
    first: DataProto,
    sample_more: Callable[[], DataProto],
    groups_needed: int,
    n: int,
    max_gen_batches: int,
    pad_token_id: int,
) -> tuple[DataProto, dict[str, float]]:
    """`groups_needed` groups of n scored responses with reward variance: `first` filtered, then as
    many `sample_more()` rounds (each a scored batch) as it takes. RuntimeError naming the limit when
    `max_gen_batches` rounds do not fill the batch. Metrics: rounds used, groups generated and dropped
    (the extra generation: generated less `groups_needed`), the dropped share."""
    kept, rounds, dropped, generated = [], 0, 0, 0
    batch = first
    while True:
        rounds += 1
        generated += len(batch) // n
        varied, dropped_now = drop_uniform_groups(batch)
        dropped += dropped_now
        kept.append(varied)
        have = sum(len(part) for part in kept) // n
        if have >= groups_needed:
            break
        if rounds >= max_gen_batches:
            raise RuntimeError(
                f"dynamic sampling found {have} of {groups_needed} prompt groups with reward variance in "
                f"{rounds} generation rounds (algorithm.filter_groups.max_num_gen_batches="
                f"{max_gen_batches}); raise it, or check the reward: it gives every response to a prompt "
                "the same score"
            )
        batch = sample_more()
    merged = concat_rounds([part for part in kept if len(part)], pad_token_id)[: groups_needed * n]
    return merged, {
        "dynamic_sampling/gen_batches": float(rounds),
        "dynamic_sampling/generated_groups": float(generated),
        "dynamic_sampling/dropped_groups": float(dropped),
        "dynamic_sampling/dropped_group_share": dropped / generated,
    }
