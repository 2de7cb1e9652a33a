"""gpt-oss's tool calls (the harmony format): the format is detected from the family's template
(template_families.py's GPT_OSS), a call the template renders parses back to the same name and
arguments, the turn's other messages are its content (reasoning excepted), and a call that cannot
run is reported for the model."""

import json
import os

import pytest
from template_families import FAMILIES

from engines.rollout.config import AgentConfig, RolloutConfig
from hybridflow.agents.template import end_of_turn_ids
from hybridflow.agents.tool_formats import FORMATS, detect_format, parse_harmony, resolve_format
from hybridflow.agents.tool_parser import MalformedToolCall, ToolCall

GPT_OSS = next(f for f in FAMILIES if f.name == "gpt-oss")
QUESTION = {"role": "user", "content": "What is 127 * 48?"}
CALC = {"expression": "127 * 48", "precision": 3, "exact": True, "options": {"units": ["m", "s"]}}
TOOLS = [
    {"type": "function", "function": {"name": "calculator", "description": "Arithmetic.", "parameters": {}}}
]


def rendered_turn(content: str | None = None) -> str:
    """The assistant turn calling the calculator, as the template writes it after the prompt."""
    tokenizer = GPT_OSS.tokenizer()
    call = {"id": "c00000000", "type": "function", "function": {"name": "calculator", "arguments": CALC}}
    turn = {"role": "assistant", "content": content, "tool_calls": [call]}
    prompt = tokenizer.apply_chat_template(
        [QUESTION], tools=TOOLS, tokenize=False, add_generation_prompt=True
    )
    whole = tokenizer.apply_chat_template([QUESTION, turn], tools=TOOLS, tokenize=False)
    return whole[len(os.path.commonprefix([prompt, whole])) :]  # noqa: RUF071 (text, not paths)


def test_the_format_is_detected_from_the_gpt_oss_template():
    assert detect_format(GPT_OSS.template) == "harmony"
    assert resolve_format("auto", GPT_OSS.tokenizer()).name == "harmony"


def test_no_other_familys_template_is_read_as_harmony():
    assert all(detect_format(f.template) != "harmony" for f in FAMILIES if f is not GPT_OSS)


def test_a_rendered_call_parses_back_to_the_same_name_and_arguments():
    text = rendered_turn()
    assert text.startswith("<|channel|>commentary to=functions.calculator") and text.endswith("<|call|>")
    assert parse_harmony(text).calls == [ToolCall("calculator", CALC)]


def test_a_preamble_before_the_call_is_the_content():
    parsed = parse_harmony(rendered_turn(content="Let me compute."))
    assert parsed.content == "Let me compute." and parsed.calls == [ToolCall("calculator", CALC)]


def test_reasoning_is_not_content_and_the_recipient_may_stand_in_the_role():
    text = (
        "<|channel|>analysis<|message|>Multiply.<|end|>"
        '<|start|>assistant to=functions.lookup<|channel|>commentary json<|message|>{"q": "x"}<|call|>'
    )
    assert parse_harmony(text) == FORMATS["harmony"].parse(text)
    assert parse_harmony(text).content == "" and parse_harmony(text).calls == [ToolCall("lookup", {"q": "x"})]


def test_a_final_answer_has_no_calls():
    assert parse_harmony("<|channel|>final<|message|>#### 6096<|return|>").content == "#### 6096"
    assert parse_harmony("The answer is 6096.").calls == []


@pytest.mark.parametrize(
    ("text", "kind"),
    [
        ("<|channel|>commentary to=functions.calculator <|constrain|>json<|message|>{x}<|call|>", "bad_json"),
        (
            '<|channel|>commentary to=functions.calculator<|message|>{"expression": "1"}<|end|>',
            "unclosed_tag",
        ),
        ('<|channel|>commentary to=functions.calculator<|message|>{"expression": ', "unclosed_tag"),
        ("<|channel|>commentary to=functions.calculator<|message|>[1]<|call|>", "bad_arguments"),
    ],
)
def test_a_malformed_call_is_reported_for_the_model(text, kind):
    (call,) = parse_harmony(text).calls
    assert isinstance(call, MalformedToolCall) and call.kind == kind and call.message


def test_a_call_turn_ends_on_call_and_an_answer_on_eos_not_on_a_messages_end():
    """<|end|> closes one message of a turn that goes on (reasoning, then a call)."""
    tokenizer = GPT_OSS.tokenizer()
    ends = end_of_turn_ids(tokenizer, [tokenizer.eos_token_id])
    assert ends == {
        tokenizer.convert_tokens_to_ids("<|call|>"),
        tokenizer.convert_tokens_to_ids("<|return|>"),
    }


@pytest.mark.parametrize("fmt", ["auto", "harmony"])
def test_the_recipe_check_accepts_the_gpt_oss_template(fmt):
    from hybridflow.checks.agents import check_chat_template
    from hybridflow.config.schema import RecipeConfig

    cfg = RecipeConfig()
    cfg.model.path = "/models/gpt-oss"
    agent = AgentConfig(
        loop="tool", tools=["hybridflow.agents.tools.calculator.Calculator"], tool_call_format=fmt
    )
    cfg.rollout = RolloutConfig(name="vllm", agent=agent)
    check_chat_template(cfg, GPT_OSS.tokenizer())


def test_the_endpoint_returns_the_call_as_an_openai_tool_call():
    from hybridflow.agents.openai_api import assistant_message

    turn = assistant_message(rendered_turn(), "stop", 0, parse_harmony)
    assert turn.finish_reason == "tool_calls" and turn.tool_calls == 1
    (call,) = turn.message["tool_calls"]
    assert call["function"]["name"] == "calculator" and json.loads(call["function"]["arguments"]) == CALC
