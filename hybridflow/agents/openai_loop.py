"""`rollout.agent.loop: openai`: agents written against the `openai` client run unchanged inside
a rollout. Each generation call starts the chat-completions endpoint (`server.py`) on its loop,
opens one session per prompt row, and runs the recipe's agent function once per row,
concurrently:

    async def run(client: openai.AsyncOpenAI, model: str, messages: list[dict], **row) -> None

`client` points at the row's session, `model` is the name to request (rollout.server.model_name),
`messages` the row's prompt (the data set's `raw_prompt`), and `row` its other fields
(`data_source`, `reward_model`, `extra_info`, ... as far as the batch carries them). The return
value is unused: what the session recorded becomes the row's `Trajectory` (chat_session.py).
"""

import asyncio
import inspect
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from engines.rollout.base import SamplingPosition, SeededGenerationMixin, is_validation, row_seed
from engines.rollout.config import SamplingConfig
from engines.rollout.requests import Completion
from hybridflow.agents.batch import trajectories_to_batch
from hybridflow.agents.chat_session import ChatSession
from hybridflow.agents.loop import session_name
from hybridflow.agents.openai_api import ChatRequest, check_recipe_sampling
from hybridflow.agents.server import ChatServer
from hybridflow.agents.template import end_of_turn_ids, message_delta_renderer, tokenize_chat
from hybridflow.agents.tool_formats import resolve_format
from hybridflow.protocol import DataProto
from hybridflow.utils.imports import import_by_path

KEY = "rollout.agent.openai_agent"


def load_openai_agent(path: str) -> Callable:
    """The `package.module:function` agent of a recipe, checked to be an async function."""
    agent = import_by_path(path, KEY, "package.module:function")
    if not inspect.iscoroutinefunction(agent):
        name = getattr(agent, "__name__", "run")
        signature = f"async def {name}(client, model, messages, **row)"
        raise TypeError(f"{KEY}={path!r} must be `{signature}`, got {agent!r}")
    return agent


def recipe_sampling_check(sampling: SamplingConfig, key: str) -> Callable[[ChatRequest], None]:
    """`check(request)`: ApiError for a request `temperature` or `top_p` other than the values
    the call samples at (greedy: temperature 0, top_p 1), set under `key` in the recipe."""
    greedy = not sampling.do_sample
    recipe = {
        "temperature": 0.0 if greedy else sampling.temperature,
        "top_p": 1.0 if greedy else sampling.top_p,
    }
    return lambda request: check_recipe_sampling(request, recipe, key)


def agent_rows(prompts: DataProto) -> list[tuple[list[dict], dict[str, Any]]]:
    """(messages, other fields) of each prompt row."""
    fields = prompts.non_tensor_batch
    if "raw_prompt" not in fields:
        raise ValueError(
            f"rollout.agent.loop=openai needs each prompt's messages: the batch given to "
            f"generate_sequences has no 'raw_prompt' (non-tensor keys: {sorted(fields)})"
        )
    return [
        (
            [dict(m) for m in fields["raw_prompt"][i]],
            {k: v[i] for k, v in fields.items() if k != "raw_prompt"},
        )
        for i in range(len(prompts))
    ]


# (session name, prompt ids, sampling, seed, max new tokens) -> the request's completion
SessionRequest = Callable[[str, list[int], SamplingConfig, int, int], Awaitable[Completion]]


def engine_requests(engine) -> SessionRequest:
    """Every session's requests on one request-level engine (`engines/rollout/requests.py`)."""

    async def request(session: str, ids: list[int], sampling: SamplingConfig, seed: int, max_new_tokens: int):
        return await engine.generate(ids, sampling, seed, max_new_tokens)

    return request


class OpenAIAgentRollout(SeededGenerationMixin):
    """`generate_sequences` through the recipe's OpenAI-client agent; `request` samples a session's
    requests (`engine_requests`, or a router's over several replicas). Seeds follow the engines'
    rules (row i of a call seeds its k-th request with row_seed(row_seed(call, i), k) unless the
    request sets `seed`); row i's session is named "<call seed>-<i>"."""

    def __init__(
        self, agent: Callable, request: SessionRequest, tokenizer, cfg, pad_token_id: int, eos_token_ids
    ):
        self.agent, self.request, self.tokenizer, self.cfg = agent, request, tokenizer, cfg
        self.pad_token_id, self.eos_token_ids = pad_token_id, end_of_turn_ids(tokenizer, eos_token_ids)
        self.render_delta = message_delta_renderer(tokenizer, cfg.chat_template_kwargs)
        self.position = SamplingPosition()

    def generate_sequences(self, prompts: DataProto) -> DataProto:
        key = "rollout.val_sampling" if is_validation(prompts.meta_info) else "rollout.sampling"
        prompts, sampling, seed = self.start_call(prompts)
        sessions = asyncio.run(self.run_agents(agent_rows(prompts), sampling, seed, key))
        trajectories = [session.trajectory() for session in sessions]
        batch = trajectories_to_batch(prompts, trajectories, self.cfg.response_length, self.pad_token_id)
        divergences = [session.divergences for session in sessions]
        batch.non_tensor_batch["agent_divergences"] = np.array(divergences, dtype=np.int64)
        return batch

    async def run_agents(self, rows, sampling: SamplingConfig, seed: int, key: str) -> list[ChatSession]:
        """Every row's agent against its own session of one server; the sessions afterwards.
        Every request samples at `sampling` (set under `key` in the recipe)."""

        def generate(session: str):
            async def sample(ids: list[int], request: ChatRequest, request_seed: int, max_new_tokens: int):
                return await self.request(session, ids, sampling, request_seed, max_new_tokens)

            return sample

        async with ChatServer(self.cfg.server, generate, recipe_sampling_check(sampling, key)) as server:
            sessions = [self.session(session_name(seed, r), row_seed(seed, r)) for r in range(len(rows))]
            server.sessions = {session.name: session for session in sessions}
            runs = (self.run_agent(server, s, *row) for s, row in zip(sessions, rows, strict=True))
            await asyncio.gather(*runs)
        return sessions

    def session(self, name: str, seed: int) -> ChatSession:
        def render_full(messages: list[dict], tools: list[dict] | None) -> list[int]:
            return tokenize_chat(self.tokenizer, messages, tools, self.cfg.chat_template_kwargs)

        return ChatSession(
            name,
            render_full,
            self.render_delta,
            self.tokenizer.decode,
            self.eos_token_ids,
            self.cfg.response_length,
            seed,
            parse_calls=resolve_format(self.cfg.agent.tool_call_format, self.tokenizer).parse,
        )

    async def run_agent(
        self, server: ChatServer, session: ChatSession, messages: list[dict], row: dict
    ) -> None:
        import openai

        client = openai.AsyncOpenAI(base_url=server.base_url(session.name), api_key="none", max_retries=0)
        try:
            await self.agent(client, self.cfg.server.model_name, messages, **row)
        except Exception as err:
            cause = session.errors[0] if session.errors else err
            raise RuntimeError(
                f"{KEY} failed in session {session.name}: {type(cause).__name__}: {cause}"
            ) from cause
        finally:
            await client.close()
        if session.errors:  # the agent went on after a 500: its trajectory misses a turn
            first = session.errors[0]
            raise RuntimeError(f"session {session.name}: the endpoint failed a request: {first}") from first


def build_openai_rollout(engine, cfg, tokenizer_dir: str) -> OpenAIAgentRollout:
    """The recipe's OpenAI-client agent over the worker's vLLM engine, with the model's tokenizer."""
    from transformers import AutoTokenizer

    from engines.rollout.requests import VLLMRequestEngine

    agent = load_openai_agent(cfg.agent.openai_agent)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    ends = end_of_turn_ids(tokenizer, engine.eos_token_ids)  # a base model's EOS does not end its turn
    requests = engine_requests(VLLMRequestEngine(engine, cfg, stop_token_ids=ends))
    return OpenAIAgentRollout(agent, requests, tokenizer, cfg, engine.pad_token_id, engine.eos_token_ids)
