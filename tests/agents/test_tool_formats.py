"""Tool-call formats per model family: each family's template renders an assistant turn's calls as
the family's models write them, and the format detected from the template reads them back to the
same names and arguments; the recipe check accepts those templates and refuses a call format no
parser knows, naming the known ones."""

import json
import os

import pytest
from template_families import FAMILIES
from tool_call_templates import QWEN3_CODER_FAMILY, UNKNOWN_FAMILY

from engines.rollout.config import AgentConfig, RolloutConfig
from hybridflow.agents.tool_formats import FORMATS, detect_format, resolve_format
from hybridflow.agents.tool_parser import MalformedToolCall, ToolCall

FAMILY_FORMATS = {
    "hermes": "hermes",
    "qwen2.5": "hermes",
    "qwen3.5": "hermes",
    "qwen3-coder": "qwen3_coder",
    "llama3.1": "llama3_json",
    "mistral-v0.3": "mistral",
    "deepseek-v3": "deepseek_v3",
}
BY_NAME = {f.name: f for f in [*FAMILIES, QWEN3_CODER_FAMILY]}
QUESTION = {"role": "user", "content": "What is 127 * 48?"}
CALC = {"expression": "127 * 48", "precision": 3, "exact": True, "options": {"units": ["m", "s"]}}
LOOKUP = {"query": "one\ntwo"}
TOOLS = [
    {"type": "function", "function": {"name": n, "description": n, "parameters": {"type": "object"}}}
    for n in ("calculator", "lookup")
]


def _call(index: int, name: str, arguments: dict) -> dict:
    return {"id": f"c0000000{index}", "type": "function", "function": {"name": name, "arguments": arguments}}


def sampled_text(family, calls: list[tuple[str, dict]], content: str = "") -> str:
    """The assistant turn as the family's template writes it: the rendering of the conversation
    with the turn, after the rendering of the question with the assistant prompt."""
    tokenizer = family.tokenizer()
    turn = {
        "role": "assistant",
        "content": content,
        "tool_calls": [_call(i, *c) for i, c in enumerate(calls)],
    }
    prompt = tokenizer.apply_chat_template(
        [QUESTION], tools=TOOLS, tokenize=False, add_generation_prompt=True
    )
    whole = tokenizer.apply_chat_template([QUESTION, turn], tools=TOOLS, tokenize=False)
    turn_text = whole[len(os.path.commonprefix([prompt, whole])) :]  # noqa: RUF071 (text, not paths)
    return turn_text.split(family.end_of_turn, 1)[0]


@pytest.mark.parametrize("family", sorted(FAMILY_FORMATS))
def test_the_format_is_detected_from_the_template(family):
    assert detect_format(BY_NAME[family].template) == FAMILY_FORMATS[family]
    assert resolve_format("auto", BY_NAME[family].tokenizer()).name == FAMILY_FORMATS[family]


@pytest.mark.parametrize("family", sorted(FAMILY_FORMATS))
def test_a_rendered_call_parses_back_to_the_same_name_and_arguments(family):
    fmt = FORMATS[FAMILY_FORMATS[family]]
    calls = (
        [("calculator", CALC)]
        if not BY_NAME[family].parallel_calls
        else [("calculator", CALC), ("lookup", LOOKUP)]
    )
    parsed = fmt.parse(sampled_text(BY_NAME[family], calls))
    assert parsed.calls == [ToolCall(name, arguments) for name, arguments in calls]


# the Llama 3.1 and Mistral templates write no content beside a call
@pytest.mark.parametrize("family", sorted(set(FAMILY_FORMATS) - {"llama3.1", "mistral-v0.3"}))
def test_the_content_before_the_calls_is_kept(family):
    fmt = FORMATS[FAMILY_FORMATS[family]]
    parsed = fmt.parse(sampled_text(BY_NAME[family], [("calculator", CALC)], content="Let me compute."))
    assert parsed.content.endswith("Let me compute.") and parsed.calls == [ToolCall("calculator", CALC)]


@pytest.mark.parametrize("family", sorted(FAMILY_FORMATS))
def test_a_plain_answer_has_no_calls(family):
    assert FORMATS[FAMILY_FORMATS[family]].parse("The answer is 6096.").calls == []


@pytest.mark.parametrize(
    ("fmt", "text", "kind"),
    [
        ("hermes", '<tool_call>{"name": "calculator", "arguments": {</tool_call>', "bad_json"),
        ("qwen3_coder", "<tool_call>\n<function=calculator>\n<parameter=expression>\n1", "unclosed_tag"),
        ("qwen3_coder", "<tool_call>\n<parameter=expression>\n1\n</parameter>\n</tool_call>", "missing_name"),
        ("llama3_json", '{"name": "calculator", "parameters": {"expression": <|eot_id|>', "bad_json"),
        ("llama3_json", '<|python_tag|>{"name": "calculator", "parameters": 3}<|eom_id|>', "bad_arguments"),
        ("mistral", '[TOOL_CALLS] [{"name": "calculator", "arguments": {}</s>', "bad_json"),
        ("mistral", '[TOOL_CALLS] [{"arguments": {}}]</s>', "missing_name"),
        (
            "deepseek_v3",
            "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>calculator\n```json\n{",
            "unclosed_tag",
        ),
        (
            "deepseek_v3",
            "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>calculator\n```json\n{x}\n```<｜tool▁call▁end｜>",
            "bad_json",
        ),
    ],
)
def test_a_malformed_call_is_reported_for_the_model(fmt, text, kind):
    (call,) = FORMATS[fmt].parse(text).calls
    assert isinstance(call, MalformedToolCall) and call.kind == kind and call.message


def test_a_llama_turn_of_two_calls_separated_by_a_semicolon():
    text = '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": 1}}<|eom_id|>'
    assert FORMATS["llama3_json"].parse(text).calls == [ToolCall("a", {}), ToolCall("b", {"x": 1})]


def test_an_unknown_format_name_is_refused_naming_the_known_ones():
    with pytest.raises(ValueError, match=r"rollout\.agent\.tool_call_format must be one of"):
        AgentConfig(tool_call_format="xml")


def _recipe(fmt: str = "auto"):
    from hybridflow.config.schema import RecipeConfig

    cfg = RecipeConfig()
    cfg.model.path = "/models/tiny"
    agent = AgentConfig(
        loop="tool", tools=["hybridflow.agents.tools.calculator.Calculator"], tool_call_format=fmt
    )
    cfg.rollout = RolloutConfig(name="vllm", agent=agent)
    return cfg


@pytest.mark.parametrize("family", sorted(FAMILY_FORMATS))
def test_the_recipe_check_accepts_each_family_template(family):
    from hybridflow.checks.agents import check_chat_template

    check_chat_template(_recipe(), BY_NAME[family].tokenizer())
    check_chat_template(_recipe(FAMILY_FORMATS[family]), BY_NAME[family].tokenizer())


def test_the_recipe_check_names_the_format_a_template_writes_when_the_recipe_names_another():
    from hybridflow.checks.agents import check_chat_template

    with pytest.raises(ValueError, match=r"set rollout\.agent\.tool_call_format: mistral"):
        check_chat_template(_recipe("hermes"), BY_NAME["mistral-v0.3"].tokenizer())


def test_the_recipe_check_refuses_a_call_format_no_parser_knows():
    from hybridflow.checks.agents import check_chat_template

    with pytest.raises(ValueError) as err:
        check_chat_template(_recipe(), UNKNOWN_FAMILY.tokenizer())
    message = str(err.value)
    assert "model.path=/models/tiny" in message and '<invoke name="calculator">' in message
    assert "hermes, qwen3_coder, llama3_json, mistral, deepseek_v3" in message


@pytest.mark.parametrize("family", ["qwen3-coder", "mistral-v0.3", "deepseek-v3", "llama3.1"])
def test_the_endpoint_returns_the_familys_calls_as_openai_tool_calls(family):
    from hybridflow.agents.openai_api import assistant_message

    parse = resolve_format("auto", BY_NAME[family].tokenizer()).parse
    turn = assistant_message(sampled_text(BY_NAME[family], [("calculator", CALC)]), "stop", 0, parse)
    assert turn.finish_reason == "tool_calls" and turn.tool_calls == 1
    (call,) = turn.message["tool_calls"]
    assert call["function"]["name"] == "calculator" and json.loads(call["function"]["arguments"]) == CALC


def test_a_format_without_an_agent_loop_is_reported_as_unread():
    from hybridflow.checks.agents import _agent_settings_unread
    from hybridflow.config.schema import RecipeConfig

    cfg = RecipeConfig()
    cfg.rollout.agent = AgentConfig(tool_call_format="mistral")
    assert _agent_settings_unread(cfg) == [
        "rollout.agent.tool_call_format=mistral has no effect with rollout.agent.loop=single_turn: "
        "only the tool and openai loops read tool calls; set rollout.agent.loop, or remove it"
    ]
