"""Whole rollout batches through the request-level engine, for partial rollouts in the trainer
(trainer.async_training.partial_rollout, docs/async.md), and single requests: the turns of agent
loops that the driver's router sends to this replica (hybridflow/trainer/rollout/routed.py).

The disaggregated rollout worker takes a weight transfer while its generation calls run (a Ray
actor with several threads). Every row of a call is a request of a `VLLMRequestEngine` with
partial rollouts on; the engine, and everything that touches vLLM, runs on one event loop in a
thread of its own, so requests of several calls share the engine's decoding steps and a transfer
lands between two of them:

    batches = RequestBatches(engine)                 # VLLMRolloutEngine, rollout TP 1
    output = batches.generate_sequences(prompts)     # any thread; blocks until the call's rows end
    completion = batches.request(ids, sampling, seed, max_new_tokens)   # one request (an agent's turn)
    version = batches.submit_update(load).result()   # load() runs on the loop, between two steps

A row interrupted by an update continues under the new weights keeping its tokens. The output is
the batch engines' layout (`assemble_rollout_output`) plus, per row,

| key | shape | meaning |
| --- | --- | --- |
| `rollout_versions` | (B, R) | policy version that sampled each response token; -1 on padding |
| `policy_version` | (B,) | the version of the row's oldest token (its first: versions only grow) |
| `prefill_tokens` | (B,) | prompt tokens vLLM took in over the row's segments |
| `prefix_cached_tokens` | (B,) | of them, those its prefix cache served |

Seeds follow the engines' rules (a call seed, then `row_seed` per row), so a call that no update
interrupts samples what the batch path samples. Which calls an update interrupts, and where,
depends on timing: a run with partial rollouts is not reproducible bit for bit.
"""

import asyncio
import threading
from concurrent.futures import Future

import torch

from engines.rollout.base import (
    assemble_rollout_output,
    pad_rows,
    row_seed,
    unpadded_prompts,
    with_prefill_counts,
)
from engines.rollout.requests import Completion, VLLMRequestEngine
from hybridflow.protocol import DataProto

NO_VERSION = -1  # rollout_versions where no token was sampled (padding, masked tail)


class RequestBatches:
    """`generate_sequences` and weight updates of one vLLM engine, from any thread."""

    def __init__(self, engine, stop_token_ids: tuple[int, ...] = ()):
        """`stop_token_ids`: where requests end beside the model's EOS (an agent turn's end)."""
        self.engine = engine
        self.requests = VLLMRequestEngine(
            engine, engine.cfg, partial_rollout=True, stop_token_ids=stop_token_ids
        )
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="rollout-requests", daemon=True)
        self._thread.start()

    def generate_sequences(self, prompts: DataProto) -> DataProto:
        return asyncio.run_coroutine_threadsafe(self._generate(prompts), self.loop).result()

    def request(self, prompt_ids: list[int], sampling, seed: int, max_new_tokens: int) -> Completion:
        """One request (an agent's turn a router sent here), from any thread; blocks until it ends."""
        generate = self.requests.generate(prompt_ids, sampling, seed, max_new_tokens)
        return asyncio.run_coroutine_threadsafe(generate, self.loop).result()

    def submit_update(self, load) -> Future:
        """Load new weights between two decoding steps (`load()` returns the version it loaded);
        the future's result is that version. In-flight rows continue under it."""

        async def update() -> int:
            await self.requests.update_weights(load)
            return self.requests.policy_version

        return asyncio.run_coroutine_threadsafe(update(), self.loop)

    def ping(self) -> Future:
        """Done once the loop runs it, between two decoding steps (a hung step never lets it)."""
        return asyncio.run_coroutine_threadsafe(asyncio.sleep(0), self.loop)

    def shutdown(self) -> None:
        """Stop the loop's thread (before the engine's own shutdown)."""
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()

    async def _generate(self, prompts: DataProto) -> DataProto:
        # on the loop: calls take their seeds in the order they reach it
        prompts, sampling, seed = self.engine.start_call(prompts)
        budget = self.engine.cfg.max_new_tokens(sampling)
        rows = enumerate(unpadded_prompts(prompts))
        calls = [self.requests.generate(ids, sampling, row_seed(seed, row), budget) for row, ids in rows]
        completions = await asyncio.gather(*calls)
        return completions_to_batch(prompts, completions, self.engine, sampling.stop)


def completions_to_batch(
    prompts: DataProto, completions: list[Completion], engine, stop: list[str]
) -> DataProto:
    """The rollout batch of one completion per prompt row, with the versions of its tokens."""
    if not completions:
        raise ValueError("a rollout call needs at least one prompt row")
    responses = pad_rows([c.token_ids for c in completions], engine.pad_token_id, torch.long)  # (B, L)
    log_probs = pad_rows([c.log_probs for c in completions], 0.0, torch.float32)  # (B, L)
    output = assemble_rollout_output(
        prompts,
        responses,
        eos_token_ids=engine.eos_token_ids,
        pad_token_id=engine.pad_token_id,
        response_length=engine.cfg.response_length,
        stop=stop,
        tokenizer=engine.tokenizer,
        log_probs=log_probs if engine.cfg.calculate_log_probs else None,
    )
    mask = output.batch["response_mask"]  # (B, R)
    versions = pad_rows([c.versions for c in completions], NO_VERSION, torch.long)  # (B, L)
    versions = torch.nn.functional.pad(versions, (0, mask.shape[1] - versions.shape[1]), value=NO_VERSION)
    output.batch["rollout_versions"] = versions.masked_fill(mask == 0, NO_VERSION)  # (B, R)
    output.batch["policy_version"] = torch.tensor([c.versions[0] for c in completions], dtype=torch.long)
    return with_prefill_counts(
        output, [c.prompt_tokens for c in completions], [c.cached_tokens for c in completions]
    )
