"""The Tool protocol: loading by dotted path with errors that name the path, the function
schemas for chat templates, and argument checks against a tool's JSON schema."""

import asyncio
import re
from pathlib import Path
from typing import Any, ClassVar

import pytest

from hybridflow.agents.tool_parser import parse_tool_calls, run_tool_calls
from hybridflow.agents.tools import Calculator, ToolError, load_tool, tool_schemas, validate_arguments
from hybridflow.agents.tools.base import check_tool


class EchoTool:
    name = "echo"
    description = "Repeats its text."
    parameters: ClassVar[dict[str, Any]] = {
        "type": "object",
        "properties": {"text": {"type": "string"}, "times": {"type": "integer", "minimum": 1}},
        "required": ["text"],
        "additionalProperties": False,
    }

    def __init__(self, separator: str = " "):
        self.separator = separator

    async def call(self, arguments: dict[str, Any]) -> str:
        return self.separator.join([arguments["text"]] * arguments.get("times", 1))


class SyncCallTool(EchoTool):
    def call(self, arguments):
        return arguments["text"]


class BadNameTool(EchoTool):
    name = "echo tool"


class BadSchemaTool(EchoTool):
    parameters: ClassVar[dict[str, Any]] = {"type": "object", "properties": {"text": {"type": "strin"}}}


class ArraySchemaTool(EchoTool):
    parameters: ClassVar[dict[str, Any]] = {"type": "array"}


ECHO_INSTANCE = EchoTool()


def test_load_tool_builds_a_class_with_kwargs_and_takes_an_instance():
    tool = load_tool(f"{__name__}.EchoTool", separator="-")
    assert asyncio.run(tool.call({"text": "ab", "times": 3})) == "ab-ab-ab"
    assert load_tool(f"{__name__}.ECHO_INSTANCE") is ECHO_INSTANCE
    assert isinstance(load_tool("hybridflow.agents.tools.calculator.Calculator"), Calculator)


@pytest.mark.parametrize(
    ("path", "kwargs", "error", "message"),
    [
        ("calculator", {}, ValueError, "must be a dotted path"),
        ("no_such_package.Tool", {}, ValueError, "'no_such_package.Tool' cannot be imported"),
        (f"{__name__}.NoSuchTool", {}, ValueError, "NoSuchTool' cannot be imported"),
        ("json.JSONDecoder", {}, TypeError, "'json.JSONDecoder' is not a Tool: it has no"),
        (f"{__name__}.SyncCallTool", {}, TypeError, "call must be `async def"),
        (f"{__name__}.BadNameTool", {}, ValueError, "name 'echo tool' must be"),
        (f"{__name__}.BadSchemaTool", {}, ValueError, "not a valid JSON schema"),
        (f"{__name__}.ArraySchemaTool", {}, ValueError, "of type 'object'"),
        (f"{__name__}.ECHO_INSTANCE", {"separator": "-"}, ValueError, "an instance, not a class, takes no"),
        (
            f"{__name__}.EchoTool",
            {"sep": "-"},
            ValueError,
            "built: TypeError: .*unexpected keyword",
        ),
    ],
)
def test_load_tool_errors_name_the_path_and_the_problem(path, kwargs, error, message):
    with pytest.raises(error, match=message):
        load_tool(path, **kwargs)


def test_tool_schemas_are_openai_function_schemas():
    echo = EchoTool()
    assert tool_schemas([Calculator(), echo]) == [
        {
            "type": "function",
            "function": {
                "name": "calculator",
                "description": Calculator.description,
                "parameters": Calculator.parameters,
            },
        },
        {
            "type": "function",
            "function": {"name": "echo", "description": "Repeats its text.", "parameters": echo.parameters},
        },
    ]


def test_tool_schemas_refuse_two_tools_of_one_name():
    with pytest.raises(ValueError, match=r"\['echo'\] appear more than once"):
        tool_schemas([EchoTool(), Calculator(), EchoTool()])


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({}, "'text' is a required property"),
        ({"text": 3}, "3 is not of type 'string' \\(at 'text'\\)"),
        ({"text": "a", "times": 0}, "0 is less than the minimum of 1 \\(at 'times'\\)"),
        (
            {"text": "a", "colour": "red"},
            "Additional properties are not allowed \\('colour' was unexpected\\)",
        ),
        (["a"], r"\['a'\] is not of type 'object'"),
    ],
)
def test_validate_arguments_explains_the_mismatch(arguments, message):
    with pytest.raises(ToolError, match=f"invalid arguments for echo: {message}"):
        validate_arguments(EchoTool(), arguments)


def test_validate_arguments_accepts_matching_arguments():
    validate_arguments(EchoTool(), {"text": "a", "times": 2})


def test_the_example_tool_of_docs_agents_md_works():
    docs = (Path(__file__).resolve().parents[2] / "docs" / "agents.md").read_text()
    [example] = re.findall(r"```python\n(.*?)```", docs, flags=re.DOTALL)
    namespace: dict[str, Any] = {}
    exec(example, namespace)
    reverse = namespace["Reverse"](max_chars=5)
    check_tool(reverse, "docs/agents.md")
    calls = parse_tool_calls(
        '<tool_call>\n{"name": "reverse", "arguments": {"text": "stressed"}}\n</tool_call>'
        '<tool_call>\n{"name": "reverse", "arguments": {"text": "abc"}}\n</tool_call>'
    )
    results = asyncio.run(run_tool_calls(calls, [reverse], timeout_s=60))
    assert [(r.text, r.error_kind) for r in results] == [
        ("Error: reverse: the text has 8 characters; at most 5", "tool_error"),
        ("cba", None),
    ]


SANDBOX = "hybridflow.agents.tools.python_sandbox.PythonSandbox"
RECIPE_TOOLS = f"""
model: {{path: /models/tiny}}
data: {{train_files: [train.parquet]}}
rollout:
  name: vllm
  agent:
    loop: tool
    tools:
      - hybridflow.agents.tools.calculator.Calculator
      - path: {SANDBOX}
        kwargs: {{timeout_s: 5, memory_mb: 512, layers: [audit]}}
"""


def test_a_recipe_passes_a_tools_constructor_arguments_and_they_are_checked_before_workers_start(tmp_path):
    from hybridflow.checks.agents import _check_agent_tools
    from hybridflow.config.loader import load_recipe

    recipe = tmp_path / "tools.yaml"
    recipe.write_text(RECIPE_TOOLS)
    cfg = load_recipe(recipe)
    calculator, sandbox = (load_tool(entry) for entry in cfg.rollout.agent.tools)
    assert isinstance(calculator, Calculator)
    assert (sandbox.timeout_s, sandbox.memory_mb, sandbox.layers) == (5, 512, ("audit",))
    assert _check_agent_tools(cfg) == []
    cfg.rollout.agent.tools[1]["kwargs"]["timeout"] = 5
    cfg.rollout.agent.tools.append({"kwargs": {}})
    assert _check_agent_tools(cfg) == [
        f"rollout.agent.tools[1]={SANDBOX!r} cannot be built: TypeError: "
        "PythonSandbox.__init__() got an unexpected keyword argument 'timeout'",
        "rollout.agent.tools[2]={'kwargs': {}} must be a dotted path 'package.module.ToolClass' or "
        "{path: package.module.ToolClass, kwargs: {...}}",
    ]
