"""Request-level generation: one token sequence in, its sampled continuation out, awaited.

The batch API (`generate_sequences`) serves a whole batch in one call; agent loops (several turns
with tool calls between them) and asynchronous training need each sequence on its own: a turn
starts when its tool results arrive, not when the slowest row of a batch finishes. Here every
request is a coroutine,

    completion = await engine.generate(prompt_ids, sampling, seed=..., max_new_tokens=...)

and the engine batches whatever requests are in flight at each decoding step (continuous
batching). Token-in-token-out: requests are token ids and so are completions; nothing is
re-tokenized. Each sampled token records the policy version that produced it.

`VLLMRequestEngine` drives vLLM's `LLMEngine` (the offline `LLM`'s, in this process) step by step
from an asyncio task: `add_request` with `RequestOutputKind.DELTA`, then `step()` while requests
are in flight, yielding to the event loop between steps so that tool calls and new requests
proceed (vllm/v1/engine/llm_engine.py, 0.32.0).
"""

import asyncio
import itertools
from dataclasses import dataclass, field
from typing import Literal

from engines.rollout.config import RolloutConfig, SamplingConfig

FinishReason = Literal["stop", "length", "abort"]


@dataclass
class Completion:
    """What one request sampled. EOS (or the token that completed a stop string) is included."""

    token_ids: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)  # of the distribution sampled from
    versions: list[int] = field(default_factory=list)  # policy version of each token
    finish_reason: FinishReason | None = None


class VLLMRequestEngine:
    """Awaitable requests over a `VLLMRolloutEngine` (rollout TP 1: one engine per process)."""

    def __init__(self, rollout, cfg: RolloutConfig):
        if cfg.tensor_model_parallel_size != 1:
            raise ValueError(
                "request-level generation (agent loops) needs rollout.tensor_model_parallel_size=1: "
                f"got {cfg.tensor_model_parallel_size}, whose ranks would have to step in lockstep"
            )
        self.rollout = rollout
        self.cfg = cfg
        self.policy_version = 0
        self._engine = rollout.llm.llm_engine
        self._ids = itertools.count()
        self._pending: dict[str, tuple[Completion, asyncio.Future]] = {}
        self._driver: asyncio.Task | None = None

    async def generate(
        self, prompt_ids: list[int], sampling: SamplingConfig, seed: int, max_new_tokens: int
    ) -> Completion:
        """Sample a continuation of `prompt_ids` (at most `max_new_tokens` tokens)."""
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        from engines.rollout.vllm_rollout import sampling_params

        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        params = sampling_params(self.cfg, sampling, seed, self.rollout.eos_token_ids)
        params.max_tokens = max_new_tokens
        params.logprobs = 0
        params.output_kind = RequestOutputKind.DELTA
        request_id = f"r{next(self._ids)}"
        future = asyncio.get_running_loop().create_future()
        self._pending[request_id] = (Completion(), future)
        self._engine.add_request(request_id, TokensPrompt(prompt_token_ids=list(prompt_ids)), params)
        if self._driver is None or self._driver.done():
            self._driver = asyncio.create_task(self._drive())
        return await future

    async def _drive(self) -> None:
        """Step the engine while requests are in flight; other coroutines run between steps."""
        try:
            while self._pending:
                for output in self._engine.step():
                    self._absorb(output)
                await asyncio.sleep(0)
        except BaseException as err:  # a failed step fails every waiting request, not just this task
            for _, future in self._pending.values():
                if not future.done():
                    future.set_exception(err)
            self._pending.clear()
            raise

    def _absorb(self, output) -> None:
        completion, future = self._pending[output.request_id]
        delta = output.outputs[0]
        ids = list(delta.token_ids)
        completion.token_ids += ids
        completion.log_probs += [step[token].logprob for step, token in zip(delta.logprobs, ids, strict=True)]
        completion.versions += [self.policy_version] * len(ids)
        if output.finished:
            completion.finish_reason = delta.finish_reason
            del self._pending[output.request_id]
            future.set_result(completion)
