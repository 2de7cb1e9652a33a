"""Tool-call formats of the model families, by name: each reads a sampled turn's text into the
content before its calls and the calls, in order.

| name | what the model writes |
| --- | --- |
| hermes | `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Hermes, Qwen2.5, Qwen3) |
| qwen3_coder | `<tool_call><function=NAME><parameter=KEY>VALUE</parameter></function></tool_call>` |
| llama3_json | `{"name": ..., "parameters": {...}}`, after `<|python_tag|>` or alone, then `<|eot_id|>` |
| mistral | `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` |
| deepseek_v3 | `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME` + a ```json |
|  | block of the arguments + `<｜tool▁call▁end｜>`, ..., `<｜tool▁calls▁end｜>` |
| harmony | `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>` (gpt-oss) |

`rollout.agent.tool_call_format: auto` picks the format from markers in the tokenizer's chat
template (`detect_format`); Hermes where none is found. A call that cannot be run is a
MalformedToolCall, which `tool_parser.run_tool_calls` answers with an error text for the model,
as it does for Hermes calls.
"""

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hybridflow.agents.tool_parser import (
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    MalformedToolCall,
    ToolCall,
    call_from_payload,
    parse_tool_calls,
)

Call = ToolCall | MalformedToolCall


@dataclass(frozen=True)
class ParsedTurn:
    """A sampled turn: the text before its first call, and its calls in order (none: an answer)."""

    content: str
    calls: list[Call]


Parse = Callable[[str], ParsedTurn]


def _before(text: str, marker: str) -> str:
    return text.split(marker, 1)[0].strip()


def parse_hermes(text: str) -> ParsedTurn:
    """Content: the text around the `<tool_call>` blocks (as vLLM's Hermes parser returns it)."""
    pieces = [text.split(TOOL_CALL_OPEN, 1)[0]]
    for segment in text.split(TOOL_CALL_OPEN)[1:]:
        pieces.append(segment.partition(TOOL_CALL_CLOSE)[2])
    return ParsedTurn("".join(pieces).strip(), parse_tool_calls(text))


# Qwen3-Coder: XML-like calls; a parameter's value is JSON where it parses as such, else the text
FUNCTION = re.compile(r"<function=([^>\n]*)>(.*?)</function>", re.DOTALL)
PARAMETER = re.compile(r"<parameter=([^>\n]*)>(.*?)</parameter>", re.DOTALL)


def parse_qwen3_coder(text: str) -> ParsedTurn:
    calls = []
    for segment in text.split(TOOL_CALL_OPEN)[1:]:
        body, closed, _ = segment.partition(TOOL_CALL_CLOSE)
        if not closed:
            calls.append(
                MalformedToolCall(
                    "unclosed_tag", f"{TOOL_CALL_OPEN} is not closed by {TOOL_CALL_CLOSE}", segment
                )
            )
        else:
            calls.append(_xml_call(body.strip()))
    return ParsedTurn(_before(text, TOOL_CALL_OPEN), calls)


def _xml_call(body: str) -> Call:
    function = FUNCTION.fullmatch(body)
    if function is None or not function.group(1).strip():
        return MalformedToolCall(
            "missing_name", "a tool call must be <function=NAME>...</function> inside <tool_call>", body
        )
    name, inner = function.group(1).strip(), function.group(2)
    leftover = PARAMETER.sub("", inner).strip()
    if leftover:
        return MalformedToolCall(
            "bad_arguments",
            f"the call of {name!r} holds {leftover[:40]!r} outside <parameter=...> tags",
            body,
        )
    return ToolCall(name, {key.strip(): _xml_value(value) for key, value in PARAMETER.findall(inner)})


def _xml_value(value: str) -> Any:
    """The template writes a string as it is and anything else as JSON, each on its own line."""
    text = value.removeprefix("\n").removesuffix("\n")
    try:
        parsed = json.loads(text)
    except json.JSONDecodeError:
        return text
    return text if isinstance(parsed, str) else parsed


# Llama 3.1 / 3.3: the whole turn is one JSON object (or several, separated by ';')
PYTHON_TAG, LLAMA_ENDS = "<|python_tag|>", ("<|eom_id|>", "<|eot_id|>")


def parse_llama3_json(text: str) -> ParsedTurn:
    content, tagged, after = text.partition(PYTHON_TAG)
    body = after if tagged else text
    for end in LLAMA_ENDS:
        body = body.split(end, 1)[0]
    body = body.strip()
    if not tagged and not body.startswith("{"):
        return ParsedTurn(text.strip(), [])  # an answer: the call is the whole turn
    return ParsedTurn(content.strip() if tagged else "", _json_objects(body))


def _json_objects(body: str) -> list[Call]:
    calls, decoder, at = [], json.JSONDecoder(), 0
    while at < len(body):
        try:
            payload, end = decoder.raw_decode(body, at)
        except json.JSONDecodeError as err:
            return [
                *calls,
                MalformedToolCall("bad_json", f"the tool call is not valid JSON ({err})", body[at:]),
            ]
        calls.append(call_from_payload(payload, body[at:end], "parameters"))
        rest = body[end:].lstrip().removeprefix(";").lstrip()  # the next call, if any
        at = len(body) - len(rest)
    return calls


TOOL_CALLS = "[TOOL_CALLS]"


def parse_mistral(text: str) -> ParsedTurn:
    content, marked, after = text.partition(TOOL_CALLS)
    if not marked:
        return ParsedTurn(text.strip(), [])
    body = after.lstrip()
    try:
        payload, _ = json.JSONDecoder().raw_decode(body)
    except json.JSONDecodeError as err:
        return ParsedTurn(
            content.strip(),
            [MalformedToolCall("bad_json", f"the tool calls are not valid JSON ({err})", body)],
        )
    if not isinstance(payload, list):
        payload = [payload]
    return ParsedTurn(
        content.strip(), [call_from_payload(call, json.dumps(call), "arguments") for call in payload]
    )


DS_BEGIN, DS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL, DS_CALL_END, DS_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
DS_BODY = re.compile(r"function" + DS_SEP + r"([^\n]*)\n```json\n(.*)\n```", re.DOTALL)


def parse_deepseek_v3(text: str) -> ParsedTurn:
    content, begun, after = text.partition(DS_BEGIN)
    if not begun:
        return ParsedTurn(text.strip(), [])
    block = after.split(DS_END, 1)[0]
    calls = []
    for segment in block.split(DS_CALL)[1:]:
        body, closed, _ = segment.partition(DS_CALL_END)
        calls.append(
            _deepseek_call(body)
            if closed
            else MalformedToolCall("unclosed_tag", f"{DS_CALL} is not closed by {DS_CALL_END}", segment)
        )
    return ParsedTurn(content.strip(), calls)


def _deepseek_call(body: str) -> Call:
    match = DS_BODY.fullmatch(body.strip())
    if match is None or not match.group(1).strip():
        return MalformedToolCall(
            "missing_name",
            f"a tool call must be function{DS_SEP}NAME then a ```json block of its arguments",
            body,
        )
    try:
        arguments = json.loads(match.group(2))
    except json.JSONDecodeError as err:
        return MalformedToolCall("bad_json", f"the arguments are not valid JSON ({err})", body)
    return call_from_payload({"name": match.group(1).strip(), "arguments": arguments}, body, "arguments")


# gpt-oss (the harmony format): a turn is messages, each `<|channel|>NAME[ to=RECIPIENT]
# [<|constrain|>json]<|message|>BODY` ended by <|end|> (more follows), <|call|> (a tool call: its
# recipient is `functions.NAME`, its body the JSON arguments) or <|return|> (the final answer); the
# messages after the first start with `<|start|>assistant` (the recipient may stand there too).
HARMONY_MESSAGE, HARMONY_CALL, HARMONY_START = "<|message|>", "<|call|>", "<|start|>"
HARMONY_ENDS = re.compile(r"<\|(?:end|call|return)\|>")
HARMONY_RECIPIENT = re.compile(r"to=functions\.([^\s<]+)")


def parse_harmony(text: str) -> ParsedTurn:
    """Content: the bodies of the turn's messages to no one on the final and commentary channels
    (the answer and preambles; analysis is reasoning); a call: a message to `functions.NAME`."""
    if HARMONY_MESSAGE not in text:
        return ParsedTurn(text.strip(), [])
    content, calls = [], []
    for header, body, end in _harmony_messages(text):
        recipient = HARMONY_RECIPIENT.search(header)
        if recipient is None:
            if "analysis" not in header:
                content.append(body.strip())
        elif end != HARMONY_CALL:
            calls.append(
                MalformedToolCall(
                    "unclosed_tag",
                    f"a call to functions.{recipient.group(1)} must end with {HARMONY_CALL}",
                    body,
                )
            )
        else:
            calls.append(_harmony_call(recipient.group(1), body))
    return ParsedTurn("\n".join(c for c in content if c), calls)


def _harmony_messages(text: str) -> list[tuple[str, str, str]]:
    """(header, body, end token or "" at the text's end) of each message of a sampled turn."""
    messages = []
    for piece in text.split(HARMONY_START):
        header, marked, rest = piece.partition(HARMONY_MESSAGE)
        if not marked:
            continue
        end = HARMONY_ENDS.search(rest)
        messages.append((header, rest[: end.start()] if end else rest, end.group(0) if end else ""))
    return messages


def _harmony_call(name: str, body: str) -> Call:
    try:
        arguments = json.loads(body)
    except json.JSONDecodeError as err:
        return MalformedToolCall("bad_json", f"the arguments are not valid JSON ({err})", body)
    return call_from_payload({"name": name, "arguments": arguments}, body, "arguments")


@dataclass(frozen=True)
class ToolCallFormat:
    name: str
    parse: Parse
    markers: tuple[str, ...]  # text in a chat template that writes calls this way (any of them)


FORMATS: dict[str, ToolCallFormat] = {
    f.name: f
    for f in (
        ToolCallFormat("hermes", parse_hermes, (TOOL_CALL_OPEN,)),
        ToolCallFormat("qwen3_coder", parse_qwen3_coder, ("<function=",)),
        ToolCallFormat("llama3_json", parse_llama3_json, (PYTHON_TAG, "ipython")),
        ToolCallFormat("mistral", parse_mistral, (TOOL_CALLS,)),
        ToolCallFormat("deepseek_v3", parse_deepseek_v3, (DS_BEGIN, "tool▁calls▁begin")),
        ToolCallFormat("harmony", parse_harmony, ("to=functions.", HARMONY_CALL)),
    )
}
# the first whose marker a template holds is its format (Qwen3-Coder before Hermes: both write
# <tool_call>; a template may describe <tool_call> in a system prompt beside another format)
DETECTION_ORDER = ("harmony", "deepseek_v3", "mistral", "qwen3_coder", "hermes", "llama3_json")
DEFAULT_FORMAT = "hermes"


def detect_format(chat_template: str | None) -> str | None:
    """The format whose markers the chat template's text holds, or None."""
    for name in DETECTION_ORDER:
        if chat_template and any(marker in chat_template for marker in FORMATS[name].markers):
            return name
    return None


def resolve_format(name: str, tokenizer) -> ToolCallFormat:
    """The format `rollout.agent.tool_call_format` names; `auto`: the one the tokenizer's chat
    template writes, Hermes where no marker is found."""
    if name == "auto":
        template = getattr(tokenizer, "chat_template", None)
        return FORMATS[detect_format(template if isinstance(template, str) else None) or DEFAULT_FORMAT]
    if name not in FORMATS:
        raise ValueError(
            f"rollout.agent.tool_call_format={name!r}: known formats are auto, {', '.join(FORMATS)}"
        )
    return FORMATS[name]
