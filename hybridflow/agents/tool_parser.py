"""Tool calls in generated text and running them.

`parse_tool_calls` reads the Qwen / Hermes chat-template format, one or several per turn:

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "127 * 48"}}
    </tool_call>

and returns, in order, a ToolCall per well-formed call and a MalformedToolCall (a kind and a
message) per malformed one. `run_tool_calls` runs them concurrently, each under a timeout, and
turns every failure (malformed call, unknown tool, arguments that do not fit the tool's schema,
timeout, ToolError, any other exception) into an error text for the model and an error kind for
the metrics: a bad call never raises out of it.
"""

import asyncio
import contextlib
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, get_args

from hybridflow.agents.tools.base import Tool, ToolError, check_unique_names, validate_arguments

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
MalformedKind = Literal["bad_json", "missing_name", "bad_arguments", "unclosed_tag"]
ErrorKind = Literal[MalformedKind, "unknown_tool", "invalid_arguments", "timeout", "tool_error", "tool_crash"]
# Every kind, for reporting zero counts too.
ERROR_KINDS: tuple[str, ...] = get_args(ErrorKind)
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class MalformedToolCall:
    """A tool call that cannot be run: `kind` for the metrics, `message` for the model, `text`
    the offending text between the tags (or after an unclosed one)."""

    kind: MalformedKind
    message: str
    text: str


@dataclass(frozen=True)
class ToolCallResult:
    """`text` is the tool's response, or an error message starting with 'Error: '."""

    text: str
    ok: bool
    error_kind: ErrorKind | None = None


def parse_tool_calls(text: str) -> list[ToolCall | MalformedToolCall]:
    """Every `<tool_call>...</tool_call>` of `text` in order; an opening tag that another one (or
    the end of the text) follows before its closing tag is an unclosed call."""
    return [_parse_segment(segment) for segment in text.split(TOOL_CALL_OPEN)[1:]]


def _parse_segment(segment: str) -> ToolCall | MalformedToolCall:
    body, closed, _ = segment.partition(TOOL_CALL_CLOSE)
    if not closed:
        return MalformedToolCall(
            "unclosed_tag", f"{TOOL_CALL_OPEN} is not closed by {TOOL_CALL_CLOSE}", segment
        )
    return _parse_body(body.strip())


def _parse_body(body: str) -> ToolCall | MalformedToolCall:
    try:
        payload = json.loads(body)
    except json.JSONDecodeError as err:
        return MalformedToolCall("bad_json", f"the tool call is not valid JSON ({err})", body)
    return call_from_payload(payload, body)


def call_from_payload(
    payload: Any, body: str, arguments_key: str = "arguments"
) -> ToolCall | MalformedToolCall:
    """The call a decoded JSON `payload` {"name": ..., <arguments_key>: {...}} names (Llama 3's
    calls name their arguments "parameters"; "arguments" is read there too); `body`: its text."""
    if not isinstance(payload, dict):
        return MalformedToolCall(
            "bad_json", f'a tool call must be a JSON object {{"name": ..., "{arguments_key}": {{...}}}}', body
        )
    key = arguments_key if arguments_key in payload or "arguments" not in payload else "arguments"
    name, arguments = payload.get("name"), payload.get(key)
    if not isinstance(name, str) or not name:
        return MalformedToolCall("missing_name", 'the tool call has no "name" string', body)
    if not isinstance(arguments, dict):
        found = "no" if key not in payload else f"a {type(arguments).__name__} as"
        return MalformedToolCall(
            "bad_arguments", f'the call of {name!r} has {found} "{key}", not a JSON object', body
        )
    return ToolCall(name, arguments)


async def run_tool_calls(
    calls: Sequence[ToolCall | MalformedToolCall],
    tools: Sequence[Tool],
    timeout_s: float,
    limit: asyncio.Semaphore | None = None,
) -> list[ToolCallResult]:
    """Runs the calls concurrently, each for at most timeout_s; one result per call, in order.
    With `limit`, a call runs once it holds the semaphore (shared by every caller that passes
    it); its timeout starts then."""
    if not timeout_s > 0:
        raise ValueError(f"run_tool_calls timeout_s={timeout_s!r}: must be a positive number of seconds")
    check_unique_names(tools)
    by_name = {tool.name: tool for tool in tools}
    limit = limit or contextlib.nullcontext()
    return list(await asyncio.gather(*(_run_one(call, by_name, timeout_s, limit) for call in calls)))


async def _run_one(
    call: ToolCall | MalformedToolCall, tools: dict[str, Tool], timeout_s: float, limit
) -> ToolCallResult:
    if isinstance(call, MalformedToolCall):
        return _failure(call.kind, call.message)
    tool = tools.get(call.name)
    if tool is None:
        return _failure("unknown_tool", f"unknown tool {call.name!r}; available: {', '.join(sorted(tools))}")
    try:
        validate_arguments(tool, call.arguments)
    except ToolError as err:
        return _failure("invalid_arguments", str(err))
    async with limit:
        return await _call_tool(tool, call.arguments, timeout_s)


async def _call_tool(tool: Tool, arguments: dict[str, Any], timeout_s: float) -> ToolCallResult:
    deadline = asyncio.timeout(timeout_s)
    try:
        async with deadline:
            text = await tool.call(arguments)
    except ToolError as err:
        return _failure("tool_error", f"{tool.name}: {err}")
    except Exception as err:
        if isinstance(err, TimeoutError) and deadline.expired():
            return _failure("timeout", f"tool {tool.name!r} timed out after {timeout_s:g} s")
        log_first_crash(tool.name, err)
        return _failure("tool_crash", f"tool {tool.name!r} failed: {type(err).__name__}: {err}")
    if not isinstance(text, str):
        return _failure("tool_crash", f"tool {tool.name!r} returned a {type(text).__name__}, not a str")
    return ToolCallResult(text, ok=True)


# (tool name, exception type) whose traceback this process has logged
_CRASHES_LOGGED: set[tuple[str, str]] = set()


def log_first_crash(tool_name: str, err: Exception) -> None:
    """The traceback of a tool's crash, once per tool and exception type in this process: every
    crash is counted and answered anyway, and a tool that fails on every call would otherwise print
    one traceback per call."""
    kind = type(err).__name__
    if (tool_name, kind) in _CRASHES_LOGGED:
        return
    _CRASHES_LOGGED.add((tool_name, kind))
    logger.warning(
        "tool %r raised %s (further %s from it are counted in agent/tool_errors, not logged)",
        tool_name, kind, kind, exc_info=err,
    )  # fmt: skip


def _failure(kind: ErrorKind, message: str) -> ToolCallResult:
    return ToolCallResult(f"Error: {message}", ok=False, error_kind=kind)
