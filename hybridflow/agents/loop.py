"""Agent loops: one trajectory per prompt, as token ids, over a request-level engine.

    trajectory = await loop.run(prompt_ids, row_seed)

`SingleTurnLoop` samples one response (what `generate_sequences` does for a batch). `ToolAgentLoop`
samples a turn, parses its tool calls (in the model family's format: `tool_formats.py`), runs them
concurrently, appends the tool responses as the chat template renders them, and samples the next
turn, until a turn calls no tool, `max_turns`, or the token budget (`rollout.response_length`).

Token-in-token-out: a trajectory's response ids are exactly the ids each turn sampled followed by
the ids of the tool responses that came after it; only tool responses are tokenized (as a piece
of the chat template), and nothing already in the trajectory is. `response_mask` is 1 on sampled
ids and 0 on tool ids; log-probs and policy versions exist for sampled ids only (0 and -1 on tool
ids). Layout of the batch they become: `trajectories_to_batch`. How tool responses render on real
chat templates: `template.py`.
"""

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from engines.rollout.base import row_seed
from engines.rollout.requests import Completion
from hybridflow.agents.template import message_delta_renderer, tool_messages

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
    tool_responses_truncated: int = 0  # tool responses cut at rollout.agent.max_tool_response_length
    prefill_tokens: int = 0  # prompt tokens the engine took in, over the turns
    cached_tokens: int = 0  # of them, those its prefix cache served (a turn reuses the last one's KV)

    def add_sampled(self, completion: Completion) -> None:
        self.response_ids += completion.token_ids
        self.response_mask += [1] * len(completion.token_ids)
        self.log_probs += completion.log_probs
        self.versions += completion.versions
        self.turns += 1
        self.prefill_tokens += completion.prompt_tokens
        self.cached_tokens += completion.cached_tokens

    def add_tool_response(self, ids: list[int]) -> None:
        self.response_ids += ids
        self.response_mask += [0] * len(ids)
        self.log_probs += [0.0] * len(ids)
        self.versions += [TOOL_VERSION] * len(ids)

    @property
    def tool_tokens(self) -> int:
        return len(self.response_mask) - sum(self.response_mask)


Generate = Callable[[list[int], int, int], Awaitable[Completion]]  # (ids, seed, max_new_tokens)


def session_name(call_seed: int, row: int) -> str:
    """The name of row `row`'s trajectory in the call seeded `call_seed`: unique in a run, and the
    same again after a resume (a router keeps a session's requests on one replica)."""
    return f"{call_seed}-{row}"


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
    names: list[str]  # the tool each response answers (its tool message's `name`)
    truncated: int = 0  # responses cut at rollout.agent.max_tool_response_length


RunTools = Callable[[str], Awaitable[ToolTurnResult | None]]  # turn text -> None when no tool call
# (what the tools answered, the turn ended on its end-of-turn token, the turn's index) -> ids
RenderTools = Callable[[ToolTurnResult, bool, int], list[int]]


class ToolAgentLoop:
    """generate -> tool calls -> tool responses -> generate ..., in token ids."""

    def __init__(
        self,
        generate: Generate,
        run_tools: RunTools,
        decode: Callable[[list[int]], str],
        render_tool_responses: RenderTools,
        budget: int,
        max_turns: int,
        end_of_turn_ids: frozenset[int],
    ):
        self.generate, self.run_tools, self.decode = generate, run_tools, decode
        self.render_tool_responses = render_tool_responses
        self.budget, self.max_turns, self.end_of_turn_ids = budget, max_turns, end_of_turn_ids

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
            trajectory.tool_responses_truncated += tools.truncated
            # a turn a stop string ended (`</tool_call>`) did not sample the template's end of turn
            closed = bool(completion.token_ids) and completion.token_ids[-1] in self.end_of_turn_ids
            ids = self.render_tool_responses(tools, closed, trajectory.turns - 1)
            if len(trajectory.response_ids) + len(ids) >= self.budget:
                return trajectory  # no room for the tool output and another turn
            trajectory.add_tool_response(ids)


def tool_response_renderer(
    tokenizer, tools: list[dict] | None = None, template_kwargs: dict | None = None
) -> RenderTools:
    """`render(result, closed, turn)`: ids of a turn's tool responses as the chat template renders
    them after the assistant turn that called them, up to and including the next assistant prompt
    (`message_delta_renderer`, with `template_kwargs`; each tool message names its tool and
    carries its call's id)."""
    render = message_delta_renderer(tokenizer, template_kwargs)

    def render_tools(result: ToolTurnResult, closed: bool, turn: int) -> list[int]:
        return render(tool_messages(result.names, result.responses, turn), tools=tools, closed=closed)

    return render_tools
