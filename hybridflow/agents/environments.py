"""Episodes against an environment (`rollout.agent.loop: environment`): each sampled turn is the
action, each observation the next user turn, and the environment's rewards are the trajectory's.

The protocol an environment follows (`Environment`; the OpenEnv connector is `openenv_env.py`):

    observation = await env.reset(seed)              # text; "" adds nothing to the prompt
    step = await env.step(action)                    # StepResult(observation, reward, done)
    await env.close()

One episode per prompt row (`EnvironmentLoop.run`):
1. reset with the row's seed (its `extra_info.seed`, else its index in the data set: the n samples
   of a prompt face the same task); a non-empty observation is appended to the row's messages as
   a user turn, and the prompt is rendered again with it (the trajectory's own `prompt_ids`);
2. sample a turn (at most `max_new_tokens` of the call's sampling settings, when set); its text,
   without the end-of-turn token, is the action of one step;
3. stop when the step says `done`, at `rollout.agent.max_turns`, or when the token budget
   (`rollout.response_length`) is spent; else append the observation as a user message rendered
   as a piece of the chat template (`template.message_delta_renderer`, response_mask 0) and go to 2.

As in the tool loop the ids trained on are exactly the sampled ones; observations are masked out.
The rewards go into the batch as `env_scores` (B, R): where each lands is `rollout.agent.
environment.reward` (`place_episode_rewards`). The reward stage takes them in place of a rule's
(`hybridflow/reward/manager.py`), in training and in validation.
"""

import asyncio
import contextlib
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from engines.rollout.base import SamplingPosition, SeededGenerationMixin, row_seed, unpadded_prompts
from hybridflow.agents.batch import trajectories_to_batch
from hybridflow.agents.loop import Generate, Trajectory
from hybridflow.protocol import DataProto

ENV_SCORES = "env_scores"  # the batch key of the rewards (hybridflow/reward/manager.py reads it)


@dataclass(frozen=True)
class StepResult:
    """What an environment answers to one action."""

    observation: str  # what the model reads next (a user turn)
    reward: float  # the step's reward (0.0 where the environment gives none)
    done: bool  # the episode is over


class Environment(Protocol):
    """One episode's environment (a session of its own)."""

    async def reset(self, seed: int) -> str: ...

    async def step(self, action: str) -> StepResult: ...

    async def close(self) -> None: ...


@dataclass
class Episode(Trajectory):
    """A trajectory with the environment's rewards: step k answered the turn whose last sampled
    token is at `reward_positions[k]` of the response."""

    step_rewards: list[float] = field(default_factory=list)
    reward_positions: list[int] = field(default_factory=list)
    done: bool = False  # the environment ended the episode (not the turn or token budget)

    def add_step(self, result: StepResult) -> None:
        if not math.isfinite(result.reward):
            raise ValueError(f"the environment returned the reward {result.reward} for step {self.turns}")
        self.step_rewards.append(result.reward)
        self.reward_positions.append(len(self.response_ids) - 1)
        self.done = result.done


def place_episode_rewards(episodes: list[Episode], response_length: int, how: str) -> torch.Tensor:
    """(B, R) rewards of `episodes` (rollout.agent.environment.reward): `sum` (the step rewards
    added) or `final` (the last step's) on each episode's last sampled token; `per_turn`: each
    step's on the last sampled token of the turn it answers. An outcome estimator (GRPO, RLOO)
    sums a row, so `per_turn` and `sum` give it the same return."""
    scores = torch.zeros(len(episodes), response_length)  # (B, R)
    for row, episode in enumerate(episodes):
        if how == "per_turn":
            for position, reward in zip(episode.reward_positions, episode.step_rewards, strict=True):
                scores[row, position] += reward
        elif episode.step_rewards:
            total = sum(episode.step_rewards) if how == "sum" else episode.step_rewards[-1]
            scores[row, episode.reward_positions[-1]] = total
    return scores


RenderMessages = Callable[[list[dict]], list[int]]  # messages -> prompt ids (with the assistant prompt)
RenderObservation = Callable[[str, bool], list[int]]  # (text, the turn was closed) -> appended ids


@dataclass
class EnvironmentLoop:
    """sample -> step -> observation -> sample ..., in token ids (the module docstring)."""

    generate: Generate
    open_environment: Callable[[], Environment]
    decode: Callable[[list[int]], str]  # a turn's ids (end of turn removed) -> the action text
    render_prompt: RenderMessages
    render_observation: RenderObservation
    budget: int  # rollout.response_length
    max_turns: int
    end_of_turn_ids: frozenset[int]
    turn_tokens: int | None = None  # tokens a turn may sample (sampling.max_new_tokens); None: the budget's
    limit: asyncio.Semaphore | None = None  # episodes open at once (max_concurrent_episodes)

    async def run(self, prompt_ids: list[int], seed: int, messages: list[dict], reset_seed: int) -> Episode:
        """The episode of one prompt row; `seed` seeds its sampling, `reset_seed` the environment."""
        async with self.limit or contextlib.nullcontext():
            environment = self.open_environment()
            try:
                return await self._play(environment, prompt_ids, seed, messages, reset_seed)
            finally:
                await environment.close()

    async def _play(
        self,
        environment: Environment,
        prompt_ids: list[int],
        seed: int,
        messages: list[dict],
        reset_seed: int,
    ) -> Episode:
        episode = Episode()
        first = await environment.reset(reset_seed)
        if first:
            episode.prompt_ids = prompt_ids = self.render_prompt([*messages, user_turn(first)])
        while True:
            left = min(self.budget - len(episode.response_ids), self.turn_tokens or self.budget)
            completion = await self.generate(
                prompt_ids + episode.response_ids, row_seed(seed, episode.turns), left
            )
            episode.add_sampled(completion)
            ids = list(completion.token_ids)
            closed = bool(ids) and ids[-1] in self.end_of_turn_ids
            result = await environment.step(self.decode(ids[:-1] if closed else ids))
            episode.add_step(result)
            # a turn cut at turn_tokens is still an action: the episode goes on while the budget lasts
            if result.done or completion.finish_reason == "abort" or episode.turns >= self.max_turns:
                return episode
            appended = self.render_observation(result.observation, closed)
            if len(episode.response_ids) + len(appended) >= self.budget:
                return episode  # no room for the observation and another turn
            episode.add_tool_response(appended)


def user_turn(text: str) -> dict:
    return {"role": "user", "content": text}


def row_messages(prompts: DataProto) -> list[list[dict]]:
    """Each prompt row's chat messages (`raw_prompt`)."""
    if "raw_prompt" not in prompts.non_tensor_batch:
        raise ValueError(
            "rollout.agent.loop=environment needs each prompt's messages: the batch given to "
            f"generate_sequences has no 'raw_prompt' (non-tensor keys: {sorted(prompts.non_tensor_batch)})"
        )
    return [[dict(m) for m in messages] for messages in prompts.non_tensor_batch["raw_prompt"]]


def reset_seeds(prompts: DataProto) -> list[int]:
    """Each row's environment seed: its `extra_info.seed`, else its index in the data set."""
    rows = prompts.non_tensor_batch
    extra = rows.get("extra_info", [None] * len(prompts))
    index = rows.get("index", range(len(prompts)))
    return [int((info or {}).get("seed", position)) for info, position in zip(extra, index, strict=True)]


# the tool loop's counts that an episode has no use for (its observation tokens stay: tool_tokens)
TOOL_CALL_COUNTS = ("tool_calls", "tool_errors", "tool_responses_truncated")


class EnvironmentRollout(SeededGenerationMixin):
    """`generate_sequences` for a chunk: one episode per row, every row's concurrently; the rows
    need their messages (`raw_prompt`). Seeds and the RNG state follow the engines' rules."""

    def __init__(self, make_loop: Callable[..., EnvironmentLoop], cfg, pad_token_id: int):
        self.make_loop, self.cfg, self.pad_token_id = make_loop, cfg, pad_token_id
        self.position = SamplingPosition()

    def generate_sequences(self, prompts: DataProto) -> DataProto:
        prompts, sampling, seed = self.start_call(prompts)
        loop = self.make_loop(sampling)
        rows = unpadded_prompts(prompts)
        episodes = asyncio.run(run_episodes(loop, rows, seed, row_messages(prompts), reset_seeds(prompts)))
        batch = trajectories_to_batch(prompts, episodes, self.cfg.response_length, self.pad_token_id)
        for name in TOOL_CALL_COUNTS:  # an episode calls no tools: zeros would read as failed calls
            del batch.non_tensor_batch[f"agent_{name}"]
        how = self.cfg.agent.environment.reward
        batch.batch[ENV_SCORES] = place_episode_rewards(episodes, self.cfg.response_length, how)
        batch.non_tensor_batch["agent_env_steps"] = np.array([len(e.step_rewards) for e in episodes])
        batch.non_tensor_batch["agent_env_done"] = np.array([int(e.done) for e in episodes])
        return batch


async def run_episodes(
    loop: EnvironmentLoop,
    prompt_ids: list[list[int]],
    seed: int,
    messages: list[list[dict]],
    resets: list[int],
) -> list[Episode]:
    """Every row's episode, concurrently (row i's sampling seeded by row_seed(seed, i))."""
    runs: list[Awaitable[Episode]] = [
        loop.run(ids, row_seed(seed, row), chat, reset)
        for row, (ids, chat, reset) in enumerate(zip(prompt_ids, messages, resets, strict=True))
    ]
    return await asyncio.gather(*runs)


def build_environment_rollout(
    engine, cfg, tokenizer_dir: str, open_environment: Callable[..., Environment]
) -> EnvironmentRollout:
    """Episodes over the worker's vLLM engine, each against `open_environment(cfg.agent.environment)`
    (the connector of its `name`)."""
    from transformers import AutoTokenizer

    from engines.rollout.requests import VLLMRequestEngine
    from hybridflow.agents.template import end_of_turn_ids, message_delta_renderer, tokenize_chat

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    kwargs, env_cfg = cfg.chat_template_kwargs, cfg.agent.environment
    render_delta = message_delta_renderer(tokenizer, kwargs)
    ends = end_of_turn_ids(tokenizer, engine.eos_token_ids)
    requests = VLLMRequestEngine(engine, cfg, stop_token_ids=ends)

    def make_loop(sampling) -> EnvironmentLoop:
        async def generate(ids: list[int], seed: int, max_new_tokens: int):
            return await requests.generate(ids, sampling, seed, max_new_tokens)

        # its bound is this call's: one event loop each
        episodes = env_cfg.max_concurrent_episodes
        limit = asyncio.Semaphore(episodes) if episodes else None
        return EnvironmentLoop(
            generate,
            lambda: open_environment(env_cfg),
            lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
            lambda messages: tokenize_chat(tokenizer, messages, None, kwargs),
            lambda text, closed: render_delta([user_turn(text)], closed=closed),
            cfg.response_length,
            cfg.agent.max_turns,
            ends,
            sampling.max_new_tokens,
            limit,
        )

    return EnvironmentRollout(make_loop, cfg, engine.pad_token_id)
