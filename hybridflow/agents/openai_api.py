"""The OpenAI chat-completions format, as plain functions: which requests the endpoint serves
(`parse_chat_request`), how a sampled turn becomes an assistant message (`assistant_message`),
and the response and error bodies. No I/O here; `hybridflow/agents/server.py` serves them.

Served: `messages` (roles system, developer, user, assistant, tool), `tools`, `max_tokens` or
`max_completion_tokens`, `temperature` and `top_p` equal to the recipe's
(`check_recipe_sampling`), `seed`, `stream` (the reply as `chat.completion.chunk` events:
`chunk_bodies`), and parameters at their default value (`n: 1`, `tool_choice: auto` ...).
Anything else is refused with a 400 naming the parameter, never ignored: a parameter the engine
would not apply changes what the agent believes it sampled. Shapes follow the OpenAI API
reference (Chat Completions, 2025), the format vLLM's and SGLang's servers also speak.
"""

import json
import time
from dataclasses import dataclass, field
from typing import Any

from hybridflow.agents.template import call_id
from hybridflow.agents.tool_formats import Parse, parse_hermes
from hybridflow.agents.tool_parser import MalformedToolCall

ROLES = ("system", "developer", "user", "assistant", "tool")  # developer: a system message for templates
# parameters accepted at these values only (the OpenAI defaults, or what the endpoint does anyway)
DEFAULT_ONLY: dict[str, tuple] = {
    "n": (1,),
    "tool_choice": ("auto",),
    "parallel_tool_calls": (True,),
    "logprobs": (False,),
    "frequency_penalty": (0, 0.0),
    "presence_penalty": (0, 0.0),
    "logit_bias": ({},),
    "stop": ([],),
}
IGNORED = ("user", "metadata", "store")  # bookkeeping fields that change nothing sampled
SERVED = (
    "model",
    "messages",
    "tools",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "seed",
    "stream",
    "stream_options",
)


class ApiError(Exception):
    """A request the endpoint refuses: an OpenAI error body with `status`, naming `param`."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.code = message, param, status, code

    def body(self) -> dict[str, Any]:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class ChatRequest:
    """The served part of a chat-completions request; None: the rollout's own setting."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # IGNORED fields, as sent
    stream: bool = False  # reply as server-sent chat.completion.chunk events
    include_usage: bool = False  # stream_options.include_usage: a last chunk with the usage


def parse_chat_request(body: Any, model_name: str) -> ChatRequest:
    """The request in `body` (decoded JSON), or ApiError naming the first parameter refused."""
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object")
    _check_parameters(body)
    if body.get("model") != model_name:
        raise ApiError(
            f"the model {body.get('model')!r} does not exist; this endpoint serves {model_name!r}",
            param="model",
            status=404,
            code="model_not_found",
        )
    return ChatRequest(
        messages=_messages(body.get("messages")),
        tools=_tools(body.get("tools")),
        max_tokens=_max_tokens(body),
        temperature=_number(body, "temperature", 0.0, 2.0),
        top_p=_number(body, "top_p", 0.0, 1.0, low_open=True),
        seed=_seed(body.get("seed")),
        extra={key: body[key] for key in IGNORED if key in body},
        stream=_flag(body, "stream"),
        include_usage=_include_usage(body),
    )


def _flag(body: dict[str, Any], key: str) -> bool:
    value = body.get(key, False)
    if not isinstance(value, bool):
        raise ApiError(f"{key} must be true or false, got {value!r}", param=key)
    return value


def _include_usage(body: dict[str, Any]) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not _flag(body, "stream"):
        raise ApiError("stream_options is only allowed with stream: true", param="stream_options")
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise ApiError('stream_options must be {"include_usage": true|false}', param="stream_options")
    return _flag(options, "include_usage")


def _check_parameters(body: dict[str, Any]) -> None:
    for key, value in body.items():
        if key in SERVED or key in IGNORED or value is None:
            continue
        if key not in DEFAULT_ONLY:
            raise ApiError(f"the parameter {key!r} is not supported by this endpoint", param=key)
        if value not in DEFAULT_ONLY[key] or isinstance(value, bool) != isinstance(
            DEFAULT_ONLY[key][0], bool
        ):
            allowed = " or ".join(json.dumps(v) for v in DEFAULT_ONLY[key])
            raise ApiError(
                f"{key}={json.dumps(value)} is not supported by this endpoint (only {allowed})", param=key
            )


def _messages(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise ApiError("messages must be a non-empty list of message objects", param="messages")
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            role = message.get("role") if isinstance(message, dict) else message
            raise ApiError(f"{where}: role {role!r} is not one of {', '.join(ROLES)}", param=where)
        message_text(message, where)
    return messages


def message_text(message: dict[str, Any], where: str = "message") -> str:
    """The content of `message` as one string: a string, null, or a list of text parts."""
    content = message.get("content")
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "".join(str(part.get("text", "")) for part in content)
    raise ApiError(f"{where}.content must be a string or a list of text parts", param=f"{where}.content")


def _tools(tools: Any) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    if not isinstance(tools, list) or not all(_is_function_tool(tool) for tool in tools):
        raise ApiError(
            'tools must be a list of {"type": "function", "function": {"name": ..., ...}}', param="tools"
        )
    return tools or None


def _is_function_tool(tool: Any) -> bool:
    function = tool.get("function") if isinstance(tool, dict) else None
    return (
        tool.get("type") == "function"
        and isinstance(function, dict)
        and isinstance(function.get("name"), str)
    )


def _max_tokens(body: dict[str, Any]) -> int | None:
    given = [key for key in ("max_completion_tokens", "max_tokens") if body.get(key) is not None]
    if len(given) == 2 and body["max_tokens"] != body["max_completion_tokens"]:
        raise ApiError("max_tokens and max_completion_tokens differ; send one", param="max_tokens")
    if not given:
        return None
    value = body[given[0]]
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ApiError(f"{given[0]} must be an integer >= 1, got {value!r}", param=given[0])
    return value


def _number(body: dict[str, Any], key: str, low: float, high: float, low_open: bool = False) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ApiError(f"{key} must be a number, got {value!r}", param=key)
    if value > high or value < low or (low_open and value == low):
        bounds = f"({low}, {high}]" if low_open else f"[{low}, {high}]"
        raise ApiError(f"{key}={value} is outside {bounds}", param=key)
    return float(value)


def _seed(value: Any) -> int | None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise ApiError(f"seed must be an integer, got {value!r}", param="seed")
    return value


def check_recipe_sampling(request: ChatRequest, recipe: dict[str, float], key: str) -> None:
    """ApiError (400) naming `temperature` or `top_p` when the request sets it to a value other
    than `recipe`'s (what the call samples at; set under `key`, rollout.sampling or
    rollout.val_sampling): the actor computes the turn's log-probs at the recipe's settings, so a
    turn sampled at others would be trained on as if it were on-policy."""
    for param in ("temperature", "top_p"):
        sent = getattr(request, param)
        if sent is not None and sent != recipe[param]:
            raise ApiError(
                f"{param}={sent:g} differs from the recipe's {key}.{param}={recipe[param]:g}, at which "
                f"the trainer computes this turn's log-probs (it would be off-policy): leave {param} "
                f"out of the request (or send {recipe[param]:g}), or set {key}.{param} in the recipe",
                param=param,
            )


@dataclass(frozen=True)
class AssistantTurn:
    """A sampled turn as the API returns it: the message, the finish reason, and how many tool
    calls it made and how many of them could not be parsed."""

    message: dict[str, Any]
    finish_reason: str
    tool_calls: int
    malformed_calls: int


def assistant_message(text: str, engine_finish: str, turn: int, parse: Parse = parse_hermes) -> AssistantTurn:
    """The assistant message of a sampled `text` (EOS removed). Its tool calls, as `parse` reads
    them (`tool_formats`: Hermes `<tool_call>` blocks by default), become `tool_calls` (ids
    `template.call_id(turn, index)`: 9 letters and digits, as Mistral's templates require) and
    content is the rest of the text (null when empty). When any call is malformed, or the turn was
    cut at the length limit, no call is extracted and the whole text is the content (as vLLM's
    Hermes parser does)."""
    parsed = parse(text) if engine_finish == "stop" else None
    calls = parsed.calls if parsed else []
    malformed = sum(isinstance(call, MalformedToolCall) for call in calls)
    if not calls or malformed:
        message = {"role": "assistant", "content": text, "tool_calls": None}
        return AssistantTurn(message, _finish_reason(engine_finish), 0, malformed)
    tool_calls = [
        {
            "id": call_id(turn, index),
            "type": "function",
            "function": {"name": call.name, "arguments": json.dumps(call.arguments)},
        }
        for index, call in enumerate(calls)
    ]
    content = parsed.content
    message = {"role": "assistant", "content": content or None, "tool_calls": tool_calls}
    return AssistantTurn(message, "tool_calls", len(tool_calls), 0)


def _finish_reason(engine_finish: str) -> str:
    if engine_finish not in ("stop", "length"):
        raise ApiError(f"the engine ended the request with {engine_finish!r}", status=500)
    return engine_finish


def completion_body(
    request_id: str, model: str, turn: AssistantTurn, prompt_tokens: int, completion_tokens: int
) -> dict[str, Any]:
    """A `chat.completion` object with one choice."""
    return {
        "id": request_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {"index": 0, "message": turn.message, "finish_reason": turn.finish_reason, "logprobs": None}
        ],
        "usage": _usage(prompt_tokens, completion_tokens),
    }


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    total = prompt_tokens + completion_tokens
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": total}


def chunk_bodies(
    request_id: str, model: str, turn: AssistantTurn, usage: tuple[int, int] | None
) -> list[dict[str, Any]]:
    """The same reply as `chat.completion.chunk` objects, as a streamed response sends them: the
    role, the content, one chunk per tool call (id, name and all its arguments), the finish reason,
    and with `usage` (prompt, completion tokens: stream_options.include_usage) a last chunk with it.
    The turn is sampled whole before the reply starts, so each piece comes in one chunk."""
    message = turn.message
    deltas: list[dict[str, Any]] = [{"role": "assistant", "content": ""}]
    if message["content"]:
        deltas.append({"content": message["content"]})
    for index, call in enumerate(message["tool_calls"] or []):
        deltas.append({"tool_calls": [{"index": index, **call}]})
    chunks = [_chunk(request_id, model, [_choice(delta, None)]) for delta in deltas]
    chunks.append(_chunk(request_id, model, [_choice({}, turn.finish_reason)]))
    if usage is not None:
        chunks.append({**_chunk(request_id, model, []), "usage": _usage(*usage)})
    return chunks


def _choice(delta: dict[str, Any], finish_reason: str | None) -> dict[str, Any]:
    return {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}


def _chunk(request_id: str, model: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "id": request_id,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
    }


def models_body(model: str) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [{"id": model, "object": "model", "created": 0, "owned_by": "hybridflow"}],
    }
