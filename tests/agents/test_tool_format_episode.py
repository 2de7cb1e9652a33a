"""A two-turn tool episode on non-Hermes templates, over a scripted engine that writes the family's
own call text: the loop reads the call with the format detected from the template, runs the real
calculator, and appends the tool response as the template renders it; the appended ids are masked
and the trajectory decodes to the template's rendering of the whole conversation."""

import asyncio

import pytest
from template_families import FAMILIES
from tool_call_templates import QWEN3_CODER_FAMILY

from engines.rollout.config import AgentConfig
from engines.rollout.requests import Completion
from hybridflow.agents.loop import ToolAgentLoop, tool_response_renderer
from hybridflow.agents.rollout import tool_runner
from hybridflow.agents.template import call_id, end_of_turn_ids, message_delta_renderer, tool_messages
from hybridflow.agents.tool_formats import resolve_format
from hybridflow.agents.tools.base import tool_schemas
from hybridflow.agents.tools.calculator import Calculator

DEEPSEEK = next(f for f in FAMILIES if f.name == "deepseek-v3")
QUESTION = [{"role": "user", "content": "What is 12*34?"}]
FINAL = "#### 408"


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("family", [QWEN3_CODER_FAMILY, DEEPSEEK], ids=lambda f: f.name)
def test_a_two_turn_episode_in_the_familys_own_call_format(family):
    tokenizer, calculator = family.tokenizer(), Calculator()
    schemas = tool_schemas([calculator])
    call = {
        "id": call_id(0, 0),
        "type": "function",
        "function": {"name": "calculator", "arguments": {"expression": "12*34"}},
    }
    assistant = {"role": "assistant", "content": "", "tool_calls": [call]}
    answers = tool_messages(["calculator"], ["408"], turn=0)

    def render(messages, generation_prompt=True):
        return tokenizer.apply_chat_template(
            messages, tools=schemas, tokenize=False, add_generation_prompt=generation_prompt
        )

    prompt = render(QUESTION)
    after_call = render([*QUESTION, assistant, *answers])
    whole = render(
        [*QUESTION, assistant, *answers, {"role": "assistant", "content": FINAL}], generation_prompt=False
    )
    call_turn = after_call[
        len(prompt) : after_call.index(family.end_of_turn, len(prompt)) + len(family.end_of_turn)
    ]
    turns = [ids(tokenizer, call_turn), ids(tokenizer, FINAL + family.end_of_turn)]

    async def generate(_ids, _seed, max_new_tokens):
        tokens = turns.pop(0)
        return Completion(tokens, [-0.1] * len(tokens), [0] * len(tokens), "stop")

    agent = AgentConfig(loop="tool", tools=["hybridflow.agents.tools.calculator.Calculator"])
    run_tools = tool_runner([calculator], agent, parse=resolve_format("auto", tokenizer).parse)
    ends = end_of_turn_ids(tokenizer, [tokenizer.eos_token_id])
    loop = ToolAgentLoop(
        generate, run_tools, tokenizer.decode, tool_response_renderer(tokenizer, schemas), 512, 4, ends
    )
    trajectory = asyncio.run(loop.run(ids(tokenizer, prompt), seed=0))

    assert trajectory.turns == 2 and trajectory.tool_calls == 1 and trajectory.tool_errors == 0
    sampled = ids(tokenizer, call_turn)
    appended = message_delta_renderer(tokenizer)(answers, tools=schemas, closed=True, after=assistant)
    assert trajectory.response_ids[len(sampled) : len(sampled) + len(appended)] == appended
    assert trajectory.response_mask == [1] * len(sampled) + [0] * len(appended) + [1] * (
        len(trajectory.response_ids) - len(sampled) - len(appended)
    )
    assert tokenizer.decode(ids(tokenizer, prompt) + trajectory.response_ids) == whole.removesuffix("\n")
