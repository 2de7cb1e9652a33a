"""Trajectories -> the batch that agent loops (rollout.py, openai_loop.py) return in place of an
engine's `generate_sequences`: the usual rollout batch (`engines/rollout/base.py`'s layout) plus
what only trajectories have:

| key | shape | meaning |
| --- | --- | --- |
| `responses` | (B, R) | sampled ids and tool-response ids, in order, right-padded |
| `response_mask` | (B, R) | 1 on sampled ids only: tool responses are not trained on |
| `attention_mask` | (B, P+R) | prompt mask, then 1 on every real response id (tool ids too) |
| `rollout_log_probs` | (B, R) | log-probs of sampled ids; 0 elsewhere |
| `rollout_versions` | (B, R) | policy version of each sampled id; -1 elsewhere |
| `prefill_tokens` | (B,) | prompt tokens the engine took in over the turns |
| `prefix_cached_tokens` | (B,) | of them, those its prefix cache served |

non-tensor keys per row: `agent_turns`, `agent_tool_calls`, `agent_tool_errors`, `agent_tool_tokens`,
`agent_tool_responses_truncated`.
"""

import numpy as np
import torch

from engines.rollout.base import unpadded_prompts, with_prefill_counts
from hybridflow.agents.loop import TOOL_VERSION, Trajectory
from hybridflow.protocol import DataProto, answer_meta

TRAJECTORY_METRICS = ("turns", "tool_calls", "tool_errors", "tool_tokens", "tool_responses_truncated")


def trajectories_to_batch(
    prompts: DataProto, trajectories: list[Trajectory], response_length: int, pad_token_id: int
) -> DataProto:
    """The rollout batch of `trajectories` (one per prompt row, in order); see the module docstring."""
    rows = len(trajectories)
    longest = max((len(t.response_ids) for t in trajectories), default=0)
    if longest > response_length:
        raise ValueError(
            f"a trajectory has {longest} tokens, more than rollout.response_length={response_length}"
        )
    responses = torch.full((rows, response_length), pad_token_id, dtype=torch.long)
    real = torch.zeros(rows, response_length, dtype=torch.long)
    mask = torch.zeros(rows, response_length, dtype=torch.long)
    log_probs = torch.zeros(rows, response_length)
    versions = torch.full((rows, response_length), TOOL_VERSION, dtype=torch.long)
    for row, trajectory in enumerate(trajectories):
        n = len(trajectory.response_ids)
        responses[row, :n] = torch.tensor(trajectory.response_ids, dtype=torch.long)
        real[row, :n] = 1
        mask[row, :n] = torch.tensor(trajectory.response_mask, dtype=torch.long)
        log_probs[row, :n] = torch.tensor(trajectory.log_probs)
        versions[row, :n] = torch.tensor(trajectory.versions, dtype=torch.long)
    prompt_ids, prompt_mask, prompt_positions = own_prompts(prompts, trajectories, pad_token_id)  # (B, P)
    steps = torch.arange(1, response_length + 1)  # (R,)
    tensors = {
        "prompts": prompt_ids,
        "responses": responses,
        "response_mask": mask,
        "input_ids": torch.cat([prompt_ids, responses], dim=1),
        "attention_mask": torch.cat([prompt_mask, real], dim=1),
        "position_ids": torch.cat([prompt_positions, prompt_positions[:, -1:] + steps[None, :]], dim=1),
        "rollout_log_probs": log_probs,
        "rollout_versions": versions,
    }
    metrics = {
        f"agent_{name}": np.array([getattr(t, name) for t in trajectories], dtype=np.int64)
        for name in TRAJECTORY_METRICS
    }
    batch = DataProto.from_dict(
        tensors=tensors,
        non_tensors={**prompts.non_tensor_batch, **metrics},
        meta_info=answer_meta(prompts.meta_info),
    )
    return with_prefill_counts(
        batch, [t.prefill_tokens for t in trajectories], [t.cached_tokens for t in trajectories]
    )


def own_prompts(
    prompts: DataProto, trajectories: list[Trajectory], pad_token_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """input_ids, attention_mask, position_ids of the prompts, where a trajectory that carries
    its own `prompt_ids` replaces its row's; left-padded to the longest as the data set pads."""
    ids, mask = prompts.batch["input_ids"], prompts.batch["attention_mask"]  # (B, P)
    if all(t.prompt_ids is None for t in trajectories):
        return ids, mask, prompts.batch["position_ids"]
    rows = [
        t.prompt_ids if t.prompt_ids is not None else own
        for t, own in zip(trajectories, unpadded_prompts(prompts), strict=True)
    ]
    width = max(ids.size(1), *map(len, rows))
    ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for row, row_ids in enumerate(rows):
        ids[row, width - len(row_ids) :] = torch.tensor(row_ids, dtype=torch.long)
        mask[row, width - len(row_ids) :] = 1
    return ids, mask, (mask.cumsum(dim=1) - 1).clamp(min=0)
