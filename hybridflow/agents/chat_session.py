"""One trajectory's conversation with the chat-completions endpoint, kept in token ids.

An agent sends its whole conversation with every request. Re-rendering and re-tokenizing it
would train on ids other than the ones sampled (the token drift of verl#3960, NeMo-Gym PR#1787):
a sampled `<tool_call>` re-rendered from its parsed JSON, or text re-tokenized across a boundary,
differs from what the model produced. So each request is matched against the previous one:

- it *continues* the conversation when its messages start with the previous request's messages
  plus the assistant message returned for it (compared on role, text, tool calls' names and
  arguments, tool_call_id and name; ids of tool calls, nulls and extra fields do not count).
  Its prompt is then the previous prompt ids + the ids sampled + only the appended messages,
  rendered as a piece of the chat template (`message_delta_renderer`);
- otherwise the history *diverged* (the agent edited, dropped or reordered earlier messages, or
  changed its tools): the messages are rendered from scratch and a new segment starts, counted.

A segment is a `Trajectory` whose `prompt_ids` are its first, fully rendered prompt; the ids of
every appended piece are masked from the loss like tool responses. `trajectory()` is the last
segment, the one trained on (docs/agents.md says why).
"""

import asyncio
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from engines.rollout.base import row_seed
from engines.rollout.requests import Completion
from hybridflow.agents.loop import Trajectory
from hybridflow.agents.openai_api import ApiError, AssistantTurn, ChatRequest, assistant_message, message_text
from hybridflow.agents.template import RenderDelta, TemplateNotIncremental
from hybridflow.agents.tool_formats import Parse, parse_hermes

RenderFull = Callable[[list[dict], list[dict] | None], list[int]]  # (messages, tools) -> prompt ids
# (prompt ids, request, seed, max_new_tokens) -> what the engine sampled
GenerateChat = Callable[[list[int], ChatRequest, int, int], Awaitable[Completion]]


def canonical(message: dict[str, Any]) -> dict[str, Any]:
    """What decides whether two messages are the same turn of a conversation."""
    out: dict[str, Any] = {"role": message["role"], "content": message_text(message)}
    calls = message.get("tool_calls") or []
    if calls:
        out["tool_calls"] = [(c["function"]["name"], _arguments(c["function"]["arguments"])) for c in calls]
    for key in ("tool_call_id", "name"):
        if message.get(key) is not None:
            out[key] = message[key]
    return out


def template_message(message: dict[str, Any]) -> dict[str, Any]:
    """`message` as chat templates take it: text content, `developer` as `system`, tool-call
    arguments as objects (as vLLM's server passes them, vllm/entrypoints/chat_utils.py)."""
    out = {key: value for key, value in message.items() if value is not None}
    out["content"] = message_text(message)
    if out["role"] == "developer":  # OpenAI's name for system instructions; templates know system
        out["role"] = "system"
    if message.get("tool_calls"):
        out["tool_calls"] = [
            {**call, "function": {**call["function"], "arguments": _arguments(call["function"]["arguments"])}}
            for call in message["tool_calls"]
        ]
    return out


def _arguments(arguments: Any) -> Any:
    if not isinstance(arguments, str):
        return arguments
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return arguments


@dataclass
class Segment:
    """A run of requests that each continued the previous one."""

    trajectory: Trajectory
    history: list[dict[str, Any]]  # canonical messages a continuation starts with
    tools: list[dict[str, Any]] | None
    closed: bool  # the last sampled turn ended on an end-of-turn id
    assistant: dict[str, Any] | None = None  # the last sampled turn, as the template takes it


@dataclass
class PlannedTurn:
    prompt_ids: list[int]
    appended_ids: list[int]  # ids put before sampling that no policy produced (masked)
    continues: Segment | None  # None: a new segment whose prompt is prompt_ids
    max_new_tokens: int  # what the trajectory's budget leaves (< 1: nothing can be sampled)


@dataclass
class Reply:
    turn: AssistantTurn
    prompt_tokens: int
    completion_tokens: int


@dataclass
class ChatSession:
    """The requests of one trajectory; `budget` is rollout.response_length, `seed` the row's."""

    name: str
    render_full: RenderFull
    render_delta: RenderDelta
    decode: Callable[[list[int]], str]
    eos_token_ids: frozenset[int]  # ids that end a turn: the model's EOS and the template's end of turn
    budget: int
    seed: int
    segments: list[Segment] = field(default_factory=list)
    requests: int = 0
    errors: list[BaseException] = field(default_factory=list)  # server-side failures, first first
    parse_calls: Parse = parse_hermes  # the tool-call format of rollout.agent.tool_call_format
    # one request at a time: a request planned while another is being sampled would be recorded as
    # continuing it, a trajectory the engine never sampled (an agent's asyncio.gather)
    _serving: asyncio.Lock = field(default_factory=asyncio.Lock, repr=False)

    @property
    def divergences(self) -> int:
        return max(len(self.segments) - 1, 0)

    def plan(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> PlannedTurn:
        """The prompt ids of a request: a continuation of the last segment, or a new one."""
        last = self.segments[-1] if self.segments else None
        if last is not None and self._continues(last, messages, tools):
            appended = [template_message(m) for m in messages[len(last.history) :]]
            try:
                ids = self.render_delta(appended, tools=tools, closed=last.closed, after=last.assistant)
            except TemplateNotIncremental:  # e.g. a user message that moves Mistral's tool list
                return self._new_segment(messages, tools)
            done = last.trajectory.prompt_ids + last.trajectory.response_ids
            left = self.budget - len(last.trajectory.response_ids) - len(ids)
            return PlannedTurn(done + ids, ids, last, left)
        return self._new_segment(messages, tools)

    def _new_segment(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> PlannedTurn:
        prompt = self.render_full([template_message(m) for m in messages], tools)
        return PlannedTurn(prompt, [], None, self.budget)

    @staticmethod
    def _continues(last: Segment, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> bool:
        if tools != last.tools or len(messages) < len(last.history):
            return False
        return [canonical(m) for m in messages[: len(last.history)]] == last.history

    async def complete(self, request: ChatRequest, generate: GenerateChat) -> Reply:
        """Sample the reply to `request` and record it, after any request of this session before it."""
        async with self._serving:
            return await self._complete(request, generate)

    async def _complete(self, request: ChatRequest, generate: GenerateChat) -> Reply:
        planned = self.plan(request.messages, request.tools)
        if planned.max_new_tokens < 1:
            return self._out_of_budget(planned)
        limit = min(planned.max_new_tokens, request.max_tokens or planned.max_new_tokens)
        seed = request.seed if request.seed is not None else row_seed(self.seed, self.requests)
        self.requests += 1
        completion = await generate(planned.prompt_ids, request, seed, limit)
        turn = self._assistant_turn(completion)
        self._record(planned, request, completion, turn)
        return Reply(turn, len(planned.prompt_ids), len(completion.token_ids))

    def _out_of_budget(self, planned: PlannedTurn) -> Reply:
        """The appended messages leave no room to sample: a reply cut at the length limit,
        without sampling (the trajectory ends before those messages, as the tool loop does)."""
        if planned.continues is None:
            raise ApiError(f"rollout.response_length={self.budget} leaves no token to sample", status=500)
        message = {"role": "assistant", "content": "", "tool_calls": None}
        return Reply(AssistantTurn(message, "length", 0, 0), len(planned.prompt_ids), 0)

    def _assistant_turn(self, completion: Completion) -> AssistantTurn:
        ids = list(completion.token_ids)
        while ids and ids[-1] in self.eos_token_ids:
            ids.pop()
        return assistant_message(self.decode(ids), completion.finish_reason, self.requests, self.parse_calls)

    def _record(
        self, planned: PlannedTurn, request: ChatRequest, completion: Completion, turn: AssistantTurn
    ):
        segment = planned.continues
        if segment is None:
            segment = Segment(Trajectory(prompt_ids=planned.prompt_ids), [], request.tools, True)
            self.segments.append(segment)
        segment.trajectory.add_tool_response(planned.appended_ids)
        segment.trajectory.add_sampled(completion)
        segment.trajectory.tool_calls += turn.tool_calls
        segment.trajectory.tool_errors += turn.malformed_calls
        segment.history = [canonical(m) for m in [*request.messages, turn.message]]
        segment.closed = bool(completion.token_ids) and completion.token_ids[-1] in self.eos_token_ids
        segment.assistant = template_message(turn.message)

    def trajectory(self) -> Trajectory:
        """The last segment's trajectory (the one trained on)."""
        if not self.segments:
            raise ValueError(f"session {self.name!r}: the agent sent no chat-completions request")
        return self.segments[-1].trajectory
