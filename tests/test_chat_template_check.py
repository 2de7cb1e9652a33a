"""The chat-template check of agent recipes, before any worker starts: the template must take the
tool role and, where it writes tool calls, write them in the <tool_call> JSON the tool parser
reads (else an error naming the tokenizer key); a template that ignores `tools=` or drops tool
calls is a warning (the tool demo's tiny model learns the calculator's format in its warm start).
The templates are small stand-ins for the families' own (tests/chat_template_stand_ins.py)."""

import logging

import pytest
from chat_template_stand_ins import BARE_JSON_CALLS, HERMES, NO_TOOL_CONTENT, NO_TOOL_ROLE

from engines.rollout.config import AgentConfig, RolloutConfig
from hybridflow.checks.agents import check_chat_template
from hybridflow.config.schema import RecipeConfig
from hybridflow.utils.tiny_model import CHAT_TEMPLATE, build_tokenizer


def agent_recipe(loop: str = "tool") -> RecipeConfig:
    cfg = RecipeConfig()
    cfg.model.path = "/models/tiny"
    tools = ["hybridflow.agents.tools.calculator.Calculator"] if loop == "tool" else []
    agent = AgentConfig(loop=loop, tools=tools, openai_agent="m:run" if loop == "openai" else "")
    cfg.rollout = RolloutConfig(name="vllm", agent=agent)
    return cfg


def tokenizer_with(template: str):
    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})  # as ChatML's
    tokenizer.chat_template = template
    return tokenizer


@pytest.mark.parametrize("loop", ["tool", "openai"])
def test_a_template_that_renders_tools_and_calls_as_the_parser_reads_them_passes(loop, caplog):
    with caplog.at_level(logging.WARNING):
        check_chat_template(agent_recipe(loop), tokenizer_with(HERMES))
    assert caplog.text == ""


@pytest.mark.parametrize(
    ("template", "message"),
    [
        (
            NO_TOOL_ROLE,
            "model.path=/models/tiny: the chat template refuses a tool call followed by its response, a "
            "message of role 'tool', which rollout.agent.loop=tool appends after every call (TemplateError: "
            "Conversation roles must be system, user or assistant)",
        ),
        (
            NO_TOOL_CONTENT,
            "model.path=/models/tiny: the chat template renders a tool message without its content",
        ),
        (
            BARE_JSON_CALLS,
            'model.path=/models/tiny: the chat template writes a tool call as \'{"name": "calculator", '
            '"parameters": {}}\', which no tool-call format reads (known: hermes, qwen3_coder, llama3_json, '
            "mistral, deepseek_v3, harmony)",
        ),
    ],
)
def test_a_template_the_tool_loop_cannot_use_is_refused_by_name(template, message):
    with pytest.raises(ValueError) as err:
        check_chat_template(agent_recipe(), tokenizer_with(template))
    assert message in str(err.value)
    assert "set model.tokenizer_path" in str(err.value)


def test_a_template_that_ignores_tools_and_calls_is_a_warning(caplog):
    """The tiny model's template: the schemas never reach the prompt and calls are not rendered,
    which only an OpenAI-style agent's conversations (sent back and rendered) lose."""
    with caplog.at_level(logging.WARNING):
        check_chat_template(agent_recipe(), tokenizer_with(CHAT_TEMPLATE))
    assert "the chat template ignores tools=: the prompts carry no tool schema" in caplog.text
    assert "writes no tool call" not in caplog.text
    with caplog.at_level(logging.WARNING):
        check_chat_template(agent_recipe("openai"), tokenizer_with(CHAT_TEMPLATE))
    assert "writes no tool call of an assistant message" in caplog.text


def test_single_turn_recipes_are_not_checked():
    check_chat_template(RecipeConfig(), tokenizer_with(NO_TOOL_ROLE))
