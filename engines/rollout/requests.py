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

Weights change between steps through `update_weights(load)`. Without partial rollouts the engine
first lets every in-flight request finish on the old weights. With them (`partial_rollout=True`)
the in-flight requests are aborted, the weights load, and each request continues as a new segment
that keeps its tokens (`engines/rollout/partial.py`): one `Completion` whose tokens carry the
version that sampled each and its log-prob under that version; `max_new_tokens` bounds all
segments together, and EOS and stop strings end it as they would end one uninterrupted request.
"""

import asyncio
import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Literal

from engines.rollout.config import RolloutConfig, SamplingConfig
from engines.rollout.partial import Segment, boundary_window_open, continuation, stop_across_boundary

FinishReason = Literal["stop", "length", "abort"]


@dataclass
class Completion:
    """What one request sampled. EOS (or the token that completed a stop string) is included."""

    token_ids: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)  # of the distribution sampled from
    versions: list[int] = field(default_factory=list)  # policy version of each token
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0  # prompt tokens vLLM took in, over the request's segments
    cached_tokens: int = 0  # of them, those its prefix cache served


@dataclass
class _Request:
    """One awaited request across its segments (a segment per weight version it spans)."""

    prompt_ids: list[int]
    sampling: SamplingConfig
    seed: int
    max_new_tokens: int
    future: asyncio.Future
    completion: Completion = field(default_factory=Completion)
    boundary_chars: int | None = None  # text length before the segment, while a stop may straddle it
    prefilled: str | None = None  # the vLLM id of the last segment whose prefill is counted


class VLLMRequestEngine:
    """Awaitable requests over a `VLLMRolloutEngine` (rollout TP 1: one engine per process).
    A request ends at the model's EOS ids and at `stop_token_ids` (an agent turn's end: the chat
    template's end-of-turn token, which a base model's EOS is not)."""

    def __init__(
        self, rollout, cfg: RolloutConfig, partial_rollout: bool = False, stop_token_ids: Iterable[int] = ()
    ):
        if cfg.tensor_model_parallel_size != 1:
            raise ValueError(
                "request-level generation (agent loops) needs rollout.tensor_model_parallel_size=1: "
                f"got {cfg.tensor_model_parallel_size}, whose ranks would have to step in lockstep"
            )
        self.rollout = rollout
        self.cfg = cfg
        self.partial_rollout = partial_rollout
        self.stop_token_ids = sorted({*rollout.eos_token_ids, *stop_token_ids})
        self.policy_version = 0
        self._engine = rollout.llm.llm_engine
        self._ids = itertools.count()
        self._pending: dict[str, _Request] = {}  # by vLLM request id (one per segment)
        self._driver: asyncio.Task | None = None

    async def generate(
        self, prompt_ids: list[int], sampling: SamplingConfig, seed: int, max_new_tokens: int
    ) -> Completion:
        """Sample a continuation of `prompt_ids` (at most `max_new_tokens` tokens)."""
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        future = asyncio.get_running_loop().create_future()
        request = _Request(list(prompt_ids), sampling, seed, max_new_tokens, future)
        self._submit(request, Segment(request.prompt_ids, max_new_tokens, seed))
        return await future

    def in_flight(self) -> list[Completion]:
        """The completions of the requests not finished yet, as sampled so far."""
        return [request.completion for request in self._pending.values()]

    async def update_weights(self, load: Callable[[], int]) -> None:
        """Load new weights between decoding steps: `load()` loads them into the rollout engine
        (e.g. `WeightReceiver.load_into`) and returns the version it now serves. With partial
        rollouts the in-flight requests are interrupted and continue under the new weights;
        without, they finish under the old ones first."""
        if not self.partial_rollout:
            while self._pending:
                await asyncio.wait({request.future for request in self._pending.values()})
        interrupted = self._interrupt()
        # no await from here on: the driver cannot step between the load and the resubmissions
        try:
            self.policy_version = load()
            if not self._engine.reset_prefix_cache():
                raise RuntimeError("vLLM kept its prefix cache after a weight update: requests hold blocks")
        except BaseException as err:  # the interrupted requests' callers would otherwise wait forever
            for request in interrupted:
                request.future.set_exception(err)
            raise
        for request in interrupted:
            self._continue(request)

    def _submit(self, request: _Request, segment: Segment) -> None:
        """Add one segment of `request` to vLLM."""
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        from engines.rollout.vllm_rollout import sampling_params

        params = sampling_params(self.cfg, request.sampling, segment.seed, self.stop_token_ids)
        params.max_tokens = segment.max_new_tokens
        params.logprobs = 0
        params.output_kind = RequestOutputKind.DELTA
        request_id = f"r{next(self._ids)}"
        self._pending[request_id] = request
        self._engine.add_request(request_id, TokensPrompt(prompt_token_ids=segment.prompt_ids), params)
        if self._driver is None or self._driver.done():
            self._driver = asyncio.create_task(self._drive())

    def _interrupt(self) -> list[_Request]:
        """Abort every in-flight segment; the requests, with their tokens so far."""
        interrupted = list(self._pending.values())
        if self._pending:
            self._engine.abort_request(list(self._pending))
        self._pending.clear()
        return interrupted

    def _continue(self, request: _Request) -> None:
        segment = continuation(
            request.prompt_ids, request.completion.token_ids, request.max_new_tokens, request.seed
        )
        if request.sampling.stop:
            request.boundary_chars = len(self._decode(request.completion.token_ids))
        self._submit(request, segment)

    async def _drive(self) -> None:
        """Step the engine while requests are in flight; other coroutines run between steps."""
        try:
            while self._pending:
                for output in self._engine.step():
                    self._absorb(output)
                await asyncio.sleep(0)
        except BaseException as err:  # a failed step fails every waiting request, not just this task
            for request in self._pending.values():
                if not request.future.done():
                    request.future.set_exception(err)
            self._pending.clear()
            raise

    def _absorb(self, output) -> None:
        request = self._pending.get(output.request_id)
        if request is None:  # a segment aborted by a weight update
            return
        if request.prefilled != output.request_id:  # the segment's first output: its prefill is done
            request.prefilled = output.request_id
            request.completion.prompt_tokens += len(output.prompt_token_ids)
            request.completion.cached_tokens += output.num_cached_tokens or 0
        delta = output.outputs[0]
        for step, token in zip(delta.logprobs, delta.token_ids, strict=True):
            self._append(request, token, step[token].logprob)
            if request.boundary_chars is not None and self._stopped_across_boundary(request):
                self._engine.abort_request([output.request_id])
                self._finish(output.request_id, "stop")
                return
        if output.finished:
            self._finish(output.request_id, delta.finish_reason)

    def _append(self, request: _Request, token: int, log_prob: float) -> None:
        request.completion.token_ids.append(token)
        request.completion.log_probs.append(log_prob)
        request.completion.versions.append(self.policy_version)

    def _stopped_across_boundary(self, request: _Request) -> bool:
        """Whether the last token completed a stop string begun before the segment's boundary
        (vLLM sees only the segment's own text); closes the check once none can straddle it."""
        stops = list(request.sampling.stop)
        text = self._decode(request.completion.token_ids)
        if stop_across_boundary(text, request.boundary_chars, stops) is not None:
            return True
        if not boundary_window_open(len(text) - request.boundary_chars, stops):
            request.boundary_chars = None
        return False

    def _finish(self, request_id: str, reason: FinishReason) -> None:
        request = self._pending.pop(request_id)
        request.completion.finish_reason = reason
        request.future.set_result(request.completion)

    def _decode(self, token_ids: list[int]) -> str:
        return self.rollout.tokenizer.decode(token_ids, skip_special_tokens=False)
