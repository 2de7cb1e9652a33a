"""Incremental rendering on the chat templates of the families people train with tools
(template_families.py): prompt ids + the sampled turn + the ids appended after it decode to
exactly the template's rendering of the whole conversation; templates that cannot be rendered
this way are refused by name."""

import asyncio

import pytest
from template_families import FAMILIES, QWEN25, Family

from engines.rollout.requests import Completion
from hybridflow.agents.chat_session import ChatSession, template_message
from hybridflow.agents.loop import ToolAgentLoop, ToolTurnResult, tool_response_renderer
from hybridflow.agents.openai_api import ChatRequest
from hybridflow.agents.template import (
    TemplateNotIncremental,
    call_id,
    check_incremental_template,
    end_of_turn_ids,
    message_delta_renderer,
    tool_messages,
)
from hybridflow.data.prompt_dataset import tokenize_chat

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate arithmetic.",
            "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
        },
    }
]
QUESTION = [{"role": "system", "content": "Be exact."}, {"role": "user", "content": "What is 12*34 and 5*6?"}]
REASONING = "<think>\nTwo products.\n</think>\n\n"


def calls_turn(family: Family, expressions: list[str]) -> tuple[dict, list[dict]]:
    """The assistant message calling the calculator on each expression, and the tool messages."""
    assistant = {
        "role": "assistant",
        "content": REASONING if family.name.startswith("qwen3") else None,
        "tool_calls": [
            {
                "id": call_id(0, i),
                "type": "function",
                "function": {"name": "calculator", "arguments": {"expression": e}},
            }
            for i, e in enumerate(expressions)
        ],
    }
    results = [str(eval(e)) for e in expressions]
    return assistant, tool_messages(["calculator"] * len(expressions), results, turn=0)


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def render(tokenizer, messages, generation_prompt=True) -> str:
    return tokenizer.apply_chat_template(
        messages, tools=TOOLS, tokenize=False, add_generation_prompt=generation_prompt
    )


def sampled_turn(family: Family, whole: str, prompt: str, closed: bool) -> str:
    """What the model sampled for the assistant turn: the whole rendering's turn, through its
    end-of-turn token (closed), or up to it (a stop string ended the turn)."""
    assert whole.startswith(prompt)
    end = whole.index(family.end_of_turn, len(prompt))
    return whole[len(prompt) : end + len(family.end_of_turn) if closed else end]


CASES = [
    (family, n, closed)
    for family in FAMILIES
    for n in ((1, 2) if family.parallel_calls else (1,))
    for closed in (True, False)
]


@pytest.mark.parametrize(
    ("family", "n_calls", "closed"),
    CASES,
    ids=[f"{f.name}-{n}call-{'eot' if c else 'stop'}" for f, n, c in CASES],
)
def test_appended_tool_responses_complete_the_whole_conversation(family, n_calls, closed):
    tokenizer = family.tokenizer()
    assistant, tools = calls_turn(family, ["12*34", "5*6"][:n_calls])
    whole = render(tokenizer, [*QUESTION, assistant, *tools])
    prompt = render(tokenizer, QUESTION)
    sampled = ids(tokenizer, sampled_turn(family, whole, prompt, closed))
    appended = message_delta_renderer(tokenizer)(tools, tools=TOOLS, closed=closed, after=assistant)
    assert tokenizer.decode(ids(tokenizer, prompt) + sampled + appended) == whole
    assert (sampled[-1] in end_of_turn_ids(tokenizer)) == closed


def test_the_end_of_turn_comes_from_the_template_not_the_tokenizers_eos():
    base = next(f for f in FAMILIES if f.name == "qwen2.5-base").tokenizer()
    assert base.eos_token == "<|endoftext|>"
    assert end_of_turn_ids(base, [base.eos_token_id]) == {
        base.eos_token_id,
        base.convert_tokens_to_ids("<|im_end|>"),
    }


def test_the_tool_loop_passes_the_turns_real_closed_state():
    """A turn stopped by `</tool_call>` (no end-of-turn sampled) is followed by the template's
    end of turn, then the tool turn: the trajectory decodes to the whole conversation."""
    family = next(f for f in FAMILIES if f.name == "qwen2.5")
    tokenizer = family.tokenizer()
    assistant, tools = calls_turn(family, ["12*34"])
    final = {"role": "assistant", "content": "#### 408"}
    whole = render(tokenizer, [*QUESTION, assistant, *tools, final], generation_prompt=False)
    prompt = render(tokenizer, QUESTION)
    turns = [
        ids(tokenizer, sampled_turn(family, whole, prompt, closed=False)),
        ids(tokenizer, "#### 408<|im_end|>"),
    ]

    async def generate(_ids, _seed, max_new_tokens):
        tokens = turns.pop(0)
        return Completion(tokens, [0.0] * len(tokens), [0] * len(tokens), "stop")

    async def run_tools(text):
        return ToolTurnResult(["408"], errors=0, names=["calculator"]) if "<tool_call>" in text else None

    render_tools = tool_response_renderer(tokenizer, tools=TOOLS)
    loop = ToolAgentLoop(
        generate, run_tools, tokenizer.decode, render_tools, 256, 4, end_of_turn_ids(tokenizer)
    )
    trajectory = asyncio.run(loop.run(ids(tokenizer, prompt), seed=0))
    assert tokenizer.decode(ids(tokenizer, prompt) + trajectory.response_ids) + "\n" == whole


@pytest.mark.parametrize("family", FAMILIES, ids=[f.name for f in FAMILIES])
def test_every_family_passes_the_recipe_check(family):
    check_incremental_template(family.tokenizer())


def test_a_template_without_an_end_of_turn_token_is_refused_by_name():
    family = next(f for f in FAMILIES if f.name == "qwen2.5")
    tokenizer = family.tokenizer()
    tokenizer.chat_template = QWEN25.replace(
        "+ message.content + '<|im_end|>\\n'", "+ message.content + '\\n'"
    )
    with pytest.raises(TemplateNotIncremental, match="writes no end-of-turn token after an assistant turn"):
        check_incremental_template(tokenizer)


def test_a_template_that_rewrites_earlier_turns_is_refused_by_name():
    """Tools written before the last user message (Mistral's) move when a user message is appended."""
    mistral = next(f for f in FAMILIES if f.name == "mistral-v0.3").tokenizer()
    render_delta = message_delta_renderer(mistral)
    with pytest.raises(
        TemplateNotIncremental, match="renders the conversation before an assistant turn differently"
    ):
        render_delta([{"role": "user", "content": "And 7*8?"}], tools=TOOLS)


def family_session(tokenizer) -> ChatSession:
    return ChatSession(
        "s",
        lambda messages, tools: tokenize_chat(tokenizer, messages, tools),
        message_delta_renderer(tokenizer),
        tokenizer.decode,
        end_of_turn_ids(tokenizer, [tokenizer.eos_token_id]),
        budget=2000,
        seed=0,
    )


def scripted(tokenizer, turns: list[str]):
    requests = []

    async def generate(ids_, request, seed, max_new_tokens):
        requests.append(list(ids_))
        tokens = ids(tokenizer, turns[len(requests) - 1])
        return Completion(tokens, [0.0] * len(tokens), [0] * len(tokens), "stop")

    return generate, requests


CHATML = [f for f in FAMILIES if f.name in ("qwen2.5", "qwen2.5-base", "qwen3.5", "hermes")]


@pytest.mark.parametrize("family", CHATML, ids=[f.name for f in CHATML])
def test_an_openai_session_continues_a_tool_call_on_the_families_templates(family):
    """The agent echoes the reply and answers its call: the second prompt is the first one + the
    sampled ids + the appended tool message, and decodes to the whole conversation's rendering."""
    tokenizer = family.tokenizer()
    assistant, _ = calls_turn(family, ["12*34"])
    whole = render(tokenizer, [*QUESTION, assistant])
    first_turn = sampled_turn(family, whole, render(tokenizer, QUESTION), closed=True)
    generate, requests = scripted(tokenizer, [first_turn, "#### 408<|im_end|>"])
    session = family_session(tokenizer)
    reply = asyncio.run(session.complete(ChatRequest(QUESTION, TOOLS), generate)).turn.message
    call = reply["tool_calls"][0]
    answer = {"role": "tool", "name": "calculator", "tool_call_id": call["id"], "content": "408"}
    history = [*QUESTION, reply, answer]
    asyncio.run(session.complete(ChatRequest(history, TOOLS), generate))
    assert requests[1][: len(requests[0])] == requests[0] and session.divergences == 0
    assert tokenizer.decode(requests[1]) == render(tokenizer, [*QUESTION, template_message(reply), answer])


def test_a_message_the_template_cannot_append_starts_a_new_segment():
    """Mistral writes the tools before the last user message: a user message after a reply moves
    them, so the session renders the conversation from scratch (a counted divergence)."""
    tokenizer = next(f for f in FAMILIES if f.name == "mistral-v0.3").tokenizer()
    generate, requests = scripted(tokenizer, [" 408</s>", " 30</s>"])
    session = family_session(tokenizer)
    reply = asyncio.run(session.complete(ChatRequest(QUESTION, TOOLS), generate)).turn.message
    follow_up = [*QUESTION, reply, {"role": "user", "content": "And 5*6?"}]
    asyncio.run(session.complete(ChatRequest(follow_up, TOOLS), generate))
    assert session.divergences == 1
    assert requests[1] == tokenize_chat(tokenizer, [template_message(m) for m in follow_up], TOOLS)


def test_the_recipe_check_refuses_a_template_the_loop_cannot_render_incrementally():
    """Before any worker starts (hybridflow/checks/agents.py), naming the tokenizer's key."""
    from engines.rollout.config import AgentConfig, RolloutConfig
    from hybridflow.checks.agents import check_chat_template
    from hybridflow.config.schema import RecipeConfig

    cfg = RecipeConfig()
    cfg.model.path = "/models/qwen"
    agent = AgentConfig(loop="tool", tools=["hybridflow.agents.tools.calculator.Calculator"])
    cfg.rollout = RolloutConfig(name="vllm", agent=agent)
    family = next(f for f in FAMILIES if f.name == "qwen2.5-base")
    check_chat_template(cfg, family.tokenizer())
    no_end = family.tokenizer()
    no_end.chat_template = QWEN25.replace("+ message.content + '<|im_end|>\\n'", "+ message.content + '\\n'")
    with pytest.raises(
        ValueError, match=r"model.path=/models/qwen: the chat template writes no end-of-turn token"
    ):
        check_chat_template(cfg, no_end)
