"""What the `hf` engine's tests share: the engine's config at their lengths and a batch of
left-padded random prompts of given lengths."""

import numpy as np
import torch

from engines.rollout.config import RolloutConfig, SamplingConfig
from hybridflow.protocol import DataProto

PROMPT_LENGTHS = [3, 6, 1, 5]
PROMPT_WIDTH = 6
RESPONSE_LENGTH = 12
MAX_NEW = 9


def make_cfg(**overrides) -> RolloutConfig:
    sampling = SamplingConfig(max_new_tokens=MAX_NEW, temperature=1.0)
    val = SamplingConfig(do_sample=False, temperature=0.0, max_new_tokens=MAX_NEW)
    fields = dict(response_length=RESPONSE_LENGTH, load_format="auto", sampling=sampling, val_sampling=val)
    return RolloutConfig(**{**fields, **overrides})


def make_prompts(lengths=PROMPT_LENGTHS, data_seed=0, **meta_info) -> DataProto:
    gen = torch.Generator().manual_seed(data_seed)
    mask = torch.zeros(len(lengths), PROMPT_WIDTH, dtype=torch.long)
    for row, length in enumerate(lengths):
        mask[row, PROMPT_WIDTH - length :] = 1
    ids = torch.randint(3, 100, mask.shape, generator=gen) * mask  # pad id 0 on the left
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    uids = np.array([f"prompt-{row}" for row in range(len(lengths))], dtype=object)
    return DataProto.from_dict(
        tensors={"input_ids": ids, "attention_mask": mask, "position_ids": positions},
        non_tensors={"uid": uids},
        meta_info=meta_info,
    )
