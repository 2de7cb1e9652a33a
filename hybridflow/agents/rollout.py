"""Agent loops in place of an engine's `generate_sequences`: every prompt row of a chunk runs its
loop concurrently over one request-level engine, and the trajectories become the usual rollout
batch (the layout of `batch.py`'s `trajectories_to_batch`).
"""

import asyncio

from engines.rollout.base import SamplingPosition, SeededGenerationMixin, row_seed, unpadded_prompts
from engines.rollout.config import AgentConfig
from hybridflow.agents.batch import trajectories_to_batch
from hybridflow.agents.loop import RunTools, ToolTurnResult, Trajectory, session_name
from hybridflow.agents.tool_formats import Parse, resolve_format
from hybridflow.agents.tool_output import Truncate, tool_response_truncator
from hybridflow.protocol import DataProto

MALFORMED_CALL_NAME = "invalid_tool_call"  # the tool message `name` answering a call that did not parse


async def run_loops(loop, prompt_ids: list[list[int]], seed: int) -> list[Trajectory]:
    """Every row's trajectory, the rows' loops running concurrently (row i seeded by row_seed)."""
    return await asyncio.gather(*(loop.run(ids, row_seed(seed, row)) for row, ids in enumerate(prompt_ids)))


def tool_runner(
    tools: list, agent: AgentConfig, truncate: Truncate | None = None, parse: Parse | None = None
) -> RunTools:
    """`run_tools(turn text)`: the turn's tool calls run, each under `agent.tool_timeout_s`, at most
    `agent.tool_call_limit()` at once over every caller (every row's loop): a sandboxed call starts
    two interpreters, and hundreds of rows calling at once would crowd out the engine. Each
    response passes through `truncate` (`tool_output.tool_response_truncator`; None: as it is).
    Calls are read by `parse` (`tool_formats`; None: Hermes `<tool_call>` JSON). Create one per
    event loop (per generation call)."""
    from hybridflow.agents.tool_formats import parse_hermes
    from hybridflow.agents.tool_parser import ToolCall, run_tool_calls

    parse = parse or parse_hermes

    limit = asyncio.Semaphore(agent.tool_call_limit())

    async def run_tools(text: str) -> ToolTurnResult | None:
        calls = parse(text).calls
        if not calls:
            return None
        results = await run_tool_calls(calls, tools, agent.tool_timeout_s, limit)
        names = [call.name if isinstance(call, ToolCall) else MALFORMED_CALL_NAME for call in calls]
        texts = [truncate(r.text) if truncate else (r.text, False) for r in results]
        return ToolTurnResult(
            [text for text, _ in texts], sum(not r.ok for r in results), names, sum(cut for _, cut in texts)
        )

    return run_tools


class AgentRollout(SeededGenerationMixin):
    """`generate_sequences` for a chunk through agent loops; `make_loop(sampling)` builds the loop
    of a call (its sampling: rollout.sampling, or val_sampling when meta_info says `validate`).
    Seeds and the RNG state follow the engines' rules (`engines.rollout.base`)."""

    def __init__(self, make_loop, cfg, pad_token_id: int):
        self.make_loop, self.cfg, self.pad_token_id = make_loop, cfg, pad_token_id
        self.position = SamplingPosition()

    def generate_sequences(self, prompts: DataProto) -> DataProto:
        prompts, sampling, seed = self.start_call(prompts)
        loop = self.make_loop(sampling)
        trajectories = asyncio.run(run_loops(loop, unpadded_prompts(prompts), seed))
        return trajectories_to_batch(prompts, trajectories, self.cfg.response_length, self.pad_token_id)


class SessionToolLoops(SeededGenerationMixin):
    """`generate_sequences` through tool loops whose requests `request(session, ids, sampling, seed,
    max_new_tokens)` samples under each row's session name (a router over several replicas); seeds
    as `AgentRollout`'s (a rollout pool's call carries its seed in meta_info)."""

    def __init__(self, loops: "ToolLoops", request, cfg, pad_token_id: int):
        self.loops, self.request, self.cfg, self.pad_token_id = loops, request, cfg, pad_token_id
        self.position = SamplingPosition()

    def generate_sequences(self, prompts: DataProto) -> DataProto:
        prompts, sampling, seed = self.start_call(prompts)
        trajectories = asyncio.run(self.run_loops(unpadded_prompts(prompts), sampling, seed))
        return trajectories_to_batch(prompts, trajectories, self.cfg.response_length, self.pad_token_id)

    async def run_loops(self, prompt_ids: list[list[int]], sampling, seed: int) -> list[Trajectory]:
        run_tools = self.loops.tool_runner()  # its bound is this call's: one event loop each
        runs = [
            self.row_loop(session_name(seed, row), sampling, run_tools).run(ids, row_seed(seed, row))
            for row, ids in enumerate(prompt_ids)
        ]
        return await asyncio.gather(*runs)

    def row_loop(self, session: str, sampling, run_tools: RunTools):
        async def generate(ids: list[int], seed: int, max_new_tokens: int):
            return await self.request(session, ids, sampling, seed, max_new_tokens)

        return self.loops.loop(generate, run_tools)


class ToolLoops:
    """What every tool-agent loop of a rollout shares (the tokenizer's pieces, the tools); `loop`
    builds one over a request function: the engine in this process, or a router's replicas."""

    def __init__(self, cfg, tokenizer, eos_token_ids: list[int]):
        from hybridflow.agents.loop import tool_response_renderer
        from hybridflow.agents.template import end_of_turn_ids
        from hybridflow.agents.tools.base import load_tool, tool_schemas

        self.cfg, self.tokenizer = cfg, tokenizer
        self.tools = [load_tool(path) for path in cfg.agent.tools]
        self.render = tool_response_renderer(tokenizer, tool_schemas(self.tools), cfg.chat_template_kwargs)
        self.truncate = tool_response_truncator(tokenizer, cfg.agent.max_tool_response_length)
        self.calls_format = resolve_format(cfg.agent.tool_call_format, tokenizer)
        # a turn ends at the template's end of turn even where the model's EOS is another token (a
        # base model's <|endoftext|>): what it would write after it is an invented next turn
        self.ends = end_of_turn_ids(tokenizer, eos_token_ids)

    def tool_runner(self) -> RunTools:
        """The tools' runner of one generation call (its bound is per event loop)."""
        return tool_runner(self.tools, self.cfg.agent, self.truncate, self.calls_format.parse)

    def loop(self, generate, run_tools: RunTools):
        """A loop whose turns `generate(ids, seed, max_new_tokens)` samples."""
        from hybridflow.agents.loop import ToolAgentLoop

        decode, budget, max_turns = self.tokenizer.decode, self.cfg.response_length, self.cfg.agent.max_turns
        return ToolAgentLoop(generate, run_tools, decode, self.render, budget, max_turns, self.ends)


def build_agent_rollout(engine, cfg, tokenizer_dir: str) -> AgentRollout:
    """Agent loops of `cfg.agent` over the worker's vLLM engine, with the model's tokenizer."""
    if cfg.agent.loop == "openai":
        from hybridflow.agents.openai_loop import build_openai_rollout

        return build_openai_rollout(engine, cfg, tokenizer_dir)
    if cfg.agent.loop == "environment":
        from hybridflow.agents.environments import build_environment_rollout
        from hybridflow.agents.openenv_env import open_environment

        return build_environment_rollout(engine, cfg, tokenizer_dir, open_environment)
    from transformers import AutoTokenizer

    from engines.rollout.requests import VLLMRequestEngine

    loops = ToolLoops(cfg, AutoTokenizer.from_pretrained(tokenizer_dir), engine.eos_token_ids)
    requests = VLLMRequestEngine(engine, cfg, stop_token_ids=loops.ends)

    def make_loop(sampling):
        async def generate(ids: list[int], seed: int, max_new_tokens: int):
            return await requests.generate(ids, sampling, seed, max_new_tokens)

        return loops.loop(generate, loops.tool_runner())  # one runner per call: one event loop each

    return AgentRollout(make_loop, cfg, engine.pad_token_id)
