"""Tool calls in the Qwen / Hermes format: parsing, and running them so that every bad call
becomes an error text for the model and a counted error kind, never an exception."""

import asyncio
from typing import Any, ClassVar

import pytest

from hybridflow.agents.tool_parser import (
    ERROR_KINDS,
    MalformedToolCall,
    ToolCall,
    ToolCallResult,
    parse_tool_calls,
    run_tool_calls,
)
from hybridflow.agents.tools import Calculator, ToolError


def tool_call(body: str) -> str:
    return f"<tool_call>\n{body}\n</tool_call>"


class ScriptedTool:
    """A tool whose behaviour the test picks with the `action` argument."""

    name = "scripted"
    description = "Does what the test asks."
    parameters: ClassVar[dict[str, Any]] = {
        "type": "object",
        "properties": {"action": {"type": "string"}},
        "required": ["action"],
    }

    def __init__(self):
        self.partner_called = asyncio.Event()

    async def call(self, arguments: dict[str, Any]) -> str:
        action = arguments["action"]
        if action == "hang":
            await asyncio.Event().wait()
        if action == "refuse":
            raise ToolError("cannot do that")
        if action == "crash":
            raise RuntimeError("boom")
        if action == "own_timeout":
            raise TimeoutError("upstream timed out")
        if action == "not_text":
            return 42
        if action == "wait_for_partner":  # finishes only if the partner call runs meanwhile
            await self.partner_called.wait()
        if action == "partner":
            self.partner_called.set()
        return f"done {action}"


def run(text: str, tools=None, timeout_s: float = 60.0) -> list[ToolCallResult]:
    tools = [Calculator(), ScriptedTool()] if tools is None else tools
    return asyncio.run(run_tool_calls(parse_tool_calls(text), tools, timeout_s))


def test_parse_reads_every_call_in_order_with_text_around():
    text = (
        "Let me compute.\n"
        + tool_call('{"name": "calculator", "arguments": {"expression": "2 + 2"}}')
        + "\nand\n"
        + '<tool_call>{"name":"python","arguments":{"code":"print(1)"}}</tool_call>'
        + "\n"
    )
    assert parse_tool_calls(text) == [
        ToolCall("calculator", {"expression": "2 + 2"}),
        ToolCall("python", {"code": "print(1)"}),
    ]
    assert parse_tool_calls("The answer is 4.") == []


@pytest.mark.parametrize(
    ("text", "kind", "message"),
    [
        (tool_call('{"name": "calculator", "arguments": {"expression": "1"}'), "bad_json", "not valid JSON"),
        (tool_call("calculator(1 + 1)"), "bad_json", "not valid JSON"),
        (tool_call('["calculator", {"expression": "1"}]'), "bad_json", "must be a JSON object"),
        (tool_call('{"arguments": {"expression": "1"}}'), "missing_name", 'no "name"'),
        (tool_call('{"name": 7, "arguments": {}}'), "missing_name", 'no "name"'),
        (
            tool_call('{"name": "calculator", "arguments": "{\\"expression\\": \\"1\\"}"}'),
            "bad_arguments",
            "a str as",
        ),
        (tool_call('{"name": "calculator"}'), "bad_arguments", 'has no "arguments"'),
        ('<tool_call>\n{"name": "calculator", "arguments": {}}', "unclosed_tag", "is not closed"),
    ],
)
def test_parse_reports_a_malformed_call_with_its_kind(text, kind, message):
    [call] = parse_tool_calls(text)
    assert isinstance(call, MalformedToolCall)
    assert call.kind == kind
    assert message in call.message


def test_an_opening_tag_before_the_closing_one_leaves_the_first_call_unclosed():
    text = '<tool_call>{"name": "a", "arguments": {}}' + tool_call('{"name": "b", "arguments": {}}')
    first, second = parse_tool_calls(text)
    assert first.kind == "unclosed_tag"
    assert second == ToolCall("b", {})


# Malformed and failing calls, each next to a good call in the same turn.
BAD_CALLS = [
    ('{"name": "calculator", "arguments": {"expression": "1 + 1"', "bad_json", "not valid JSON"),
    ('{"arguments": {"expression": "1 + 1"}}', "missing_name", 'no "name"'),
    ('{"name": "calculator", "arguments": ["1 + 1"]}', "bad_arguments", "a list as"),
    (
        '{"name": "search", "arguments": {"query": "x"}}',
        "unknown_tool",
        "unknown tool 'search'; available: calculator, scripted",
    ),
    (
        '{"name": "calculator", "arguments": {"expression": 11}}',
        "invalid_arguments",
        "11 is not of type 'string'",
    ),
    ('{"name": "calculator", "arguments": {}}', "invalid_arguments", "'expression' is a required property"),
    (
        '{"name": "scripted", "arguments": {"action": "hang"}}',
        "timeout",
        "tool 'scripted' timed out after 0.5 s",
    ),
    ('{"name": "scripted", "arguments": {"action": "crash"}}', "tool_crash", "failed: RuntimeError: boom"),
    ('{"name": "scripted", "arguments": {"action": "refuse"}}', "tool_error", "scripted: cannot do that"),
    (
        '{"name": "calculator", "arguments": {"expression": "import os"}}',
        "tool_error",
        "calculator: cannot parse",
    ),
    ('{"name": "scripted", "arguments": {"action": "own_timeout"}}', "tool_crash", "TimeoutError: upstream"),
    ('{"name": "scripted", "arguments": {"action": "not_text"}}', "tool_crash", "returned a int, not a str"),
]


@pytest.mark.parametrize(("body", "kind", "message"), BAD_CALLS)
def test_a_bad_call_becomes_an_error_text_and_kind_not_an_exception(body, kind, message):
    good = tool_call('{"name": "calculator", "arguments": {"expression": "6 * 7"}}')
    bad, good_result = run(tool_call(body) + good, timeout_s=0.5)
    assert bad.ok is False and bad.error_kind == kind
    assert bad.text.startswith("Error: ") and message in bad.text
    assert good_result == ToolCallResult("42", ok=True)


def test_every_error_kind_is_reachable_and_listed():
    kinds = {kind for _, kind, _ in BAD_CALLS} | {"unclosed_tag"}
    assert kinds == set(ERROR_KINDS)


def test_calls_run_concurrently():
    # The first call can only finish once the second has run: in sequence it would time out.
    text = tool_call('{"name": "scripted", "arguments": {"action": "wait_for_partner"}}') + tool_call(
        '{"name": "scripted", "arguments": {"action": "partner"}}'
    )
    assert [r.text for r in run(text)] == ["done wait_for_partner", "done partner"]


def test_run_tool_calls_refuses_a_bad_configuration():
    with pytest.raises(ValueError, match="timeout_s=0"):
        run("", timeout_s=0)
    with pytest.raises(ValueError, match="appear more than once"):
        run("", tools=[Calculator(), Calculator()])


def test_a_crashing_tool_logs_its_traceback_once_per_exception_type_not_once_per_call(caplog):
    """A tool that raises is a tool error each time (counted, the model reads the message), but its
    traceback is logged once per tool and exception type in the process: a 2-step run used to
    print one per call (64)."""

    class Crashing(ScriptedTool):
        name = f"crashing_{id(caplog)}"  # a name no other test's tool has: the memory is per process

    crash = tool_call(f'{{"name": "{Crashing.name}", "arguments": {{"action": "crash"}}}}')
    own_timeout = tool_call(f'{{"name": "{Crashing.name}", "arguments": {{"action": "own_timeout"}}}}')
    results = run(crash * 3, tools=[Crashing()]) + run(crash + own_timeout, tools=[Crashing()])
    assert [r.error_kind for r in results] == ["tool_crash"] * 5
    logged = [record for record in caplog.records if Crashing.name in record.getMessage()]
    assert [record.exc_info[0] for record in logged] == [RuntimeError, TimeoutError]
    assert (
        "further RuntimeError from it are counted in agent/tool_errors, not logged" in logged[0].getMessage()
    )
