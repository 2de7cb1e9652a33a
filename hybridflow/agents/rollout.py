"""Agent loops in place of an engine's `generate_sequences`: every prompt row of a chunk runs its
loop concurrently over one request-level engine, and the trajectories become the usual rollout
batch (`engines/rollout/base.py`'s layout) plus what only trajectories have:

| key | shape | meaning |
| --- | --- | --- |
| `responses` | (B, R) | sampled ids and tool-response ids, in order, right-padded |
| `response_mask` | (B, R) | 1 on sampled ids only: tool responses are not trained on |
| `attention_mask` | (B, P+R) | prompt mask, then 1 on every real response id (tool ids too) |
| `rollout_log_probs` | (B, R) | log-probs of sampled ids; 0 elsewhere |
| `rollout_versions` | (B, R) | policy version of each sampled id; -1 elsewhere |

non-tensor keys per row: `agent_turns`, `agent_tool_calls`, `agent_tool_errors`, `agent_tool_tokens`.
"""

import asyncio

import numpy as np
import torch

from engines.rollout.base import SeededGenerationMixin, row_seed, unpadded_prompts
from hybridflow.agents.loop import TOOL_VERSION, Trajectory
from hybridflow.protocol import DataProto

TRAJECTORY_METRICS = ("turns", "tool_calls", "tool_errors", "tool_tokens")


async def run_loops(loop, prompt_ids: list[list[int]], seed: int) -> list[Trajectory]:
    """Every row's trajectory, the rows' loops running concurrently (row i seeded by row_seed)."""
    return await asyncio.gather(*(loop.run(ids, row_seed(seed, row)) for row, ids in enumerate(prompt_ids)))


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
    return DataProto.from_dict(
        tensors=tensors, non_tensors={**prompts.non_tensor_batch, **metrics}, meta_info=prompts.meta_info
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


class AgentRollout(SeededGenerationMixin):
    """`generate_sequences` for a chunk through agent loops; `make_loop(sampling)` builds the loop
    of a call (its sampling: rollout.sampling, or val_sampling when meta_info says `validate`).
    Seeds and the RNG state follow the engines' rules (`engines.rollout.base`)."""

    def __init__(self, make_loop, cfg, pad_token_id: int):
        self.make_loop, self.cfg, self.pad_token_id = make_loop, cfg, pad_token_id
        self._calls = 0

    def generate_sequences(self, prompts: DataProto) -> DataProto:
        prompts, sampling, seed = self.start_call(prompts)
        loop = self.make_loop(sampling)
        trajectories = asyncio.run(run_loops(loop, unpadded_prompts(prompts), seed))
        return trajectories_to_batch(prompts, trajectories, self.cfg.response_length, self.pad_token_id)


def build_agent_rollout(engine, cfg, tokenizer_dir: str) -> AgentRollout:
    """Agent loops of `cfg.agent` over the worker's vLLM engine, with the model's tokenizer."""
    if cfg.agent.loop == "openai":
        from hybridflow.agents.openai_loop import build_openai_rollout

        return build_openai_rollout(engine, cfg, tokenizer_dir)
    from transformers import AutoTokenizer

    from engines.rollout.requests import VLLMRequestEngine
    from hybridflow.agents.loop import ToolAgentLoop, ToolTurnResult, tool_response_renderer
    from hybridflow.agents.tool_parser import parse_tool_calls, run_tool_calls
    from hybridflow.agents.tools.base import load_tool

    requests = VLLMRequestEngine(engine, cfg)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tools = [load_tool(path) for path in cfg.agent.tools]
    render = tool_response_renderer(tokenizer)

    async def run_tools(text: str) -> ToolTurnResult | None:
        calls = parse_tool_calls(text)
        if not calls:
            return None
        results = await run_tool_calls(calls, tools, cfg.agent.tool_timeout_s)
        return ToolTurnResult([r.text for r in results], errors=sum(not r.ok for r in results))

    def make_loop(sampling) -> ToolAgentLoop:
        async def generate(ids: list[int], seed: int, max_new_tokens: int):
            return await requests.generate(ids, sampling, seed, max_new_tokens)

        return ToolAgentLoop(
            generate, run_tools, tokenizer.decode, render, cfg.response_length, cfg.agent.max_turns
        )

    return AgentRollout(make_loop, cfg, engine.pad_token_id)
