"""rollout.agent.max_tool_response_length: a tool response longer than it reaches the model cut to
that many tokens with a visible marker, and each cut is counted in the step metrics."""

import asyncio
from typing import Any, ClassVar

import pytest
import torch

from engines.rollout.config import AgentConfig
from engines.rollout.requests import Completion
from hybridflow.agents.batch import trajectories_to_batch
from hybridflow.agents.loop import ToolAgentLoop, ToolTurnResult
from hybridflow.agents.rollout import tool_runner
from hybridflow.agents.tool_output import TRUNCATED_MARKER, tool_response_truncator
from hybridflow.protocol import DataProto
from hybridflow.utils.tiny_model import build_tokenizer

CALL = '<tool_call>\n{"name": "dump", "arguments": {}}\n</tool_call>'


class Dump:
    """A tool that answers with `text`."""

    name = "dump"
    description = "Prints a lot."
    parameters: ClassVar[dict[str, Any]] = {"type": "object", "properties": {}}

    def __init__(self, text: str):
        self.text = text

    async def call(self, arguments: dict[str, Any]) -> str:
        return self.text


def _run(text: str, limit: int) -> ToolTurnResult:
    tokenizer = build_tokenizer()
    agent = AgentConfig(loop="tool", tools=["tests.dump"], max_tool_response_length=limit)
    run_tools = tool_runner([Dump(text)], agent, truncate=tool_response_truncator(tokenizer, limit))
    return asyncio.run(run_tools(CALL * 2))


def test_a_long_tool_response_is_cut_to_the_limit_with_a_marker():
    tokenizer = build_tokenizer()
    long = "0123456789" * 1000
    result = _run(long, limit=8)
    head = tokenizer(long, add_special_tokens=False)["input_ids"][:8]
    assert result.responses == [tokenizer.decode(head) + TRUNCATED_MARKER] * 2
    assert "(truncated)" in TRUNCATED_MARKER
    assert result.truncated == 2 and result.errors == 0


def test_a_response_within_the_limit_is_unchanged():
    result = _run("42", limit=8)
    assert result.responses == ["42", "42"] and result.truncated == 0


def test_truncated_responses_are_counted_per_trajectory_in_the_batch():
    script = [[5, 1], [6, 1]]
    requests = []

    async def generate(ids, seed, max_new_tokens):
        requests.append(ids)
        return Completion(script[len(requests) - 1], [-0.5, -0.5], [0, 0], "stop")

    async def run_tools(text):
        return ToolTurnResult(["r"], 0, ["t"], truncated=1) if len(requests) == 1 else None

    loop = ToolAgentLoop(generate, run_tools, str, lambda result, closed, turn: [9, 9], 64, 4, frozenset({1}))
    trajectory = asyncio.run(loop.run([2, 3], seed=0))
    assert trajectory.tool_responses_truncated == 1
    prompts = DataProto.from_dict(
        {"input_ids": torch.tensor([[2, 3]]), "attention_mask": torch.ones(1, 2, dtype=torch.long),
         "position_ids": torch.tensor([[0, 1]])}
    )  # fmt: skip
    batch = trajectories_to_batch(prompts, [trajectory], 16, 0)
    assert batch.non_tensor_batch["agent_tool_responses_truncated"].tolist() == [1]


@pytest.mark.parametrize("bad", [0, -3])
def test_a_limit_below_one_token_is_refused(bad):
    with pytest.raises(ValueError, match=r"rollout\.agent\.max_tool_response_length must be >= 1"):
        AgentConfig(loop="tool", tools=["tests.dump"], max_tool_response_length=bad)


def test_none_leaves_tool_responses_unbounded():
    assert AgentConfig(loop="tool", tools=["tests.dump"], max_tool_response_length=None)


def test_the_limit_without_the_tool_loop_is_reported_as_unread():
    from hybridflow.checks.agents import _agent_settings_unread
    from hybridflow.config.schema import RecipeConfig

    cfg = RecipeConfig()
    cfg.rollout.agent = AgentConfig(max_tool_response_length=64)
    assert _agent_settings_unread(cfg) == [
        "rollout.agent.max_tool_response_length=64 has no effect with rollout.agent.loop=single_turn: "
        "only loop=tool reads it; set rollout.agent.loop=tool, or remove it"
    ]
