"""Agent loops: one trajectory per prompt, as token ids, over a request-level engine.

    trajectory = await loop.run(prompt_ids, row_seed)

`SingleTurnLoop` samples one response (what `generate_sequences` does for a batch). `ToolAgentLoop`
samples a turn, parses its tool calls (Qwen/Hermes `<tool_call>{json}</tool_call>`), runs them
concurrently, appends the tool responses as the chat template renders them, and samples the next
turn, until a turn calls no tool, `max_turns`, or the token budget (`rollout.response_length`).

Token-in-token-out: a trajectory's response ids are exactly the ids each turn sampled followed by
the ids of the tool responses that came after it; only tool responses are tokenized (as a piece
of the chat template), and nothing already in the trajectory is. `response_mask` is 1 on sampled
ids and 0 on tool ids; log-probs and policy versions exist for sampled ids only (0 and -1 on tool
ids). Layout of the batch they become: `trajectories_to_batch`.
"""

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from engines.rollout.base import row_seed
from engines.rollout.requests import Completion

TOOL_VERSION = -1  # the policy version recorded for tool-response tokens (no policy produced them)


@dataclass
class Trajectory:
    """One prompt's response: turns of sampled ids with tool-response ids between them."""

    response_ids: list[int] = field(default_factory=list)
    response_mask: list[int] = field(default_factory=list)  # 1 sampled, 0 tool response
    log_probs: list[float] = field(default_factory=list)  # 0.0 on tool-response tokens
    versions: list[int] = field(default_factory=list)  # TOOL_VERSION on tool-response tokens
    # the ids the response continues when they are not the prompt row's (an OpenAI-client agent
    # writes its own messages: hybridflow/agents/openai_loop.py); None: the prompt row's
    prompt_ids: list[int] | None = None
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0

    def add_sampled(self, completion: Completion) -> None:
        self.response_ids += completion.token_ids
        self.response_mask += [1] * len(completion.token_ids)
        self.log_probs += completion.log_probs
        self.versions += completion.versions
        self.turns += 1

    def add_tool_response(self, ids: list[int]) -> None:
        self.response_ids += ids
        self.response_mask += [0] * len(ids)
        self.log_probs += [0.0] * len(ids)
        self.versions += [TOOL_VERSION] * len(ids)

    @property
    def tool_tokens(self) -> int:
        return len(self.response_mask) - sum(self.response_mask)


Generate = Callable[[list[int], int, int], Awaitable[Completion]]  # (ids, seed, max_new_tokens)


class SingleTurnLoop:
    """One sampled response per prompt."""

    def __init__(self, generate: Generate, budget: int):
        self.generate, self.budget = generate, budget

    async def run(self, prompt_ids: list[int], seed: int) -> Trajectory:
        trajectory = Trajectory()
        trajectory.add_sampled(await self.generate(prompt_ids, seed, self.budget))
        return trajectory


@dataclass
class ToolTurnResult:
    """What the tools answered to one turn: the tool-response text of each call, and failures."""

    responses: list[str]
    errors: int


RunTools = Callable[[str], Awaitable[ToolTurnResult | None]]  # turn text -> None when no tool call


class ToolAgentLoop:
    """generate -> tool calls -> tool responses -> generate ..., in token ids."""

    def __init__(
        self,
        generate: Generate,
        run_tools: RunTools,
        decode: Callable[[list[int]], str],
        render_tool_responses: Callable[[list[str]], list[int]],
        budget: int,
        max_turns: int,
    ):
        self.generate, self.run_tools, self.decode = generate, run_tools, decode
        self.render_tool_responses = render_tool_responses
        self.budget, self.max_turns = budget, max_turns

    async def run(self, prompt_ids: list[int], seed: int) -> Trajectory:
        trajectory = Trajectory()
        while True:
            left = self.budget - len(trajectory.response_ids)
            turn_seed = row_seed(seed, trajectory.turns)
            completion = await self.generate(prompt_ids + trajectory.response_ids, turn_seed, left)
            trajectory.add_sampled(completion)
            if completion.finish_reason != "stop" or trajectory.turns >= self.max_turns:
                return trajectory  # out of budget, or the last turn allowed
            tools = await self.run_tools(self.decode(completion.token_ids))
            if tools is None:
                return trajectory  # a final answer
            trajectory.tool_calls += len(tools.responses)
            trajectory.tool_errors += tools.errors
            ids = self.render_tool_responses(tools.responses)
            if len(trajectory.response_ids) + len(ids) >= self.budget:
                return trajectory  # no room for the tool output and another turn
            trajectory.add_tool_response(ids)


def tool_response_renderer(tokenizer, tool_role: str = "tool") -> Callable[[list[str]], list[int]]:
    """Ids of tool responses as the chat template renders them after an assistant turn, up to
    and including the next assistant prompt (`message_delta_renderer` with one `tool_role`
    message per response)."""
    render = message_delta_renderer(tokenizer)
    return lambda responses: render([{"role": tool_role, "content": text} for text in responses])


RenderDelta = Callable[..., list[int]]  # (messages, tools=None, closed=True) -> ids


def message_delta_renderer(tokenizer) -> RenderDelta:
    """`render(messages, tools=None, closed=True)`: ids of `messages` as the chat template renders
    them after an assistant turn, up to and including the next assistant prompt. A turn that
    ended on EOS is `closed`: whatever the template writes after the EOS (a newline, the next
    role's header ...) belongs to these ids. A turn cut short (no EOS sampled) is not: the ids
    then start with the template's end of the assistant turn (the EOS). Only this piece is
    tokenized, so the ids before it are never re-tokenized."""
    eos = tokenizer.eos_token
    assistant = [{"role": "assistant", "content": "x"}]

    def render(messages: list[dict], tools: list[dict] | None = None, closed: bool = True) -> list[int]:
        before = tokenizer.apply_chat_template(assistant, tools=tools, tokenize=False)
        end_of_turn = before.rindex(eos)
        cut = end_of_turn + len(eos) if closed else before.rindex("x", 0, end_of_turn) + 1
        text = tokenizer.apply_chat_template(
            assistant + messages, tools=tools, tokenize=False, add_generation_prompt=True
        )
        if text[:cut] != before[:cut]:
            raise ValueError(
                "the chat template renders an assistant turn differently when other messages follow"
            )
        return tokenizer(text[cut:], add_special_tokens=False)["input_ids"]

    return render
