"""Worker for test_partial_rollout.py: partial rollouts on the real vLLM engine (CPU build), in a
process of its own (vLLM changes process-wide torch state).

    python tests/async_rl/_partial_worker.py MODEL_DIR OUT_FILE

One engine, started from the model as is (version 0), EOS switched off so that no request ends
before its `MAX_NEW_TOKENS`. Three runs of `PROMPTS` sampled at temperature 1 with fixed seeds:
  reference  partial rollouts on, no weight update: every token of version 0;
  partial    partial rollouts on; once every request has sampled `SWITCH_AT` tokens, version 1
             (`versioned_tensors`) is loaded: the requests continue under it;
  drain      partial rollouts off; at `SWITCH_AT` tokens version 2 is loaded: the request
             finishes under version 1 first.
Writes each run's completions, and what each weight load saw in flight, to OUT_FILE (torch.save).

Then whole batches of `PROMPTS` on the same engine, back at version 0, as the disaggregated rollout
worker runs them with partial rollouts (`RequestBatches`, its event loop in a thread of its own):
  batch_path     the engine's own `generate_sequences`, seeded;
  batches        the same call through `RequestBatches`, no update;
  batches_split  the same call again; a weight update submitted from another thread once every
                 row has SWITCH_AT tokens (the loop is held there until the update is queued).

Then a second engine, with a tokenizer (stop strings need one; vLLM then also stops on EOS):
  split      row 0 as in `partial`, switched to version 1 after SWITCH_AT tokens;
  stop       the same again from version 0, with the stop string `STOP_CHARS` characters around
             the boundary of `split` (the last one before it and the first after): the request
             must end on it, though vLLM's own matching sees only one side of it.
"""

import asyncio
import dataclasses
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _transfer_worker import versioned_tensors

from engines.rollout.config import RolloutConfig, SamplingConfig
from engines.rollout.request_batches import RequestBatches
from engines.rollout.requests import VLLMRequestEngine
from engines.rollout.vllm_rollout import VLLMRolloutEngine
from hybridflow.protocol import DataProto

PROMPTS = [[5, 17, 42, 9, 33], [71, 8, 8, 23]]
SEEDS = [101, 202]
MAX_NEW_TOKENS = 24
SWITCH_AT = 8
SAMPLING = SamplingConfig(do_sample=True, temperature=1.0)
STOP_CHARS = 2


def load_version(engine: VLLMRolloutEngine, model_dir: str, version: int) -> int:
    """`versioned_tensors(version)` into the engine, through its weight-update session."""
    engine.begin_weight_update()
    engine.update_weights(versioned_tensors(model_dir, version))
    engine.end_weight_update()
    return version


def loader(engine: VLLMRolloutEngine, requests: VLLMRequestEngine, model_dir: str, version: int, seen: dict):
    """A `load` for `update_weights`: records the requests still in flight, then loads `version`."""

    def load() -> int:
        seen["at_load"] = len(requests.in_flight())
        return load_version(engine, model_dir, version)

    return load


def all_sampled(requests: VLLMRequestEngine, count: int, tokens: int) -> bool:
    """Whether `count` requests are in flight, each with at least `tokens` tokens sampled."""
    in_flight = requests.in_flight()
    return len(in_flight) == count and all(len(c.token_ids) >= tokens for c in in_flight)


async def sample(requests: VLLMRequestEngine, rows: range, update=None, seen=None, sampling=SAMPLING) -> list:
    """The completions of `rows`; `update` is awaited once each of them has SWITCH_AT tokens,
    and `seen["before"]` holds the tokens they had then."""
    calls = [requests.generate(PROMPTS[r], sampling, SEEDS[r], MAX_NEW_TOKENS) for r in rows]
    tasks = [asyncio.ensure_future(call) for call in calls]
    if update is not None:
        while not all_sampled(requests, len(rows), SWITCH_AT):
            if any(task.done() for task in tasks):
                raise RuntimeError(f"a request finished before it sampled {SWITCH_AT} tokens")
            await asyncio.sleep(0)  # the engine steps between these checks
        seen["before"] = [list(c.token_ids) for c in requests.in_flight()]
        await requests.update_weights(update)  # runs at once: nothing steps in between
    return [dataclasses.asdict(c) for c in await asyncio.gather(*tasks)]


def main(model_dir: str, out_file: str) -> None:
    cfg = RolloutConfig(
        name="vllm", load_format="auto", response_length=MAX_NEW_TOKENS, sampling=SAMPLING,
        calculate_log_probs=True, vllm={"max_model_len": 64},
    )  # fmt: skip
    engine = VLLMRolloutEngine(model_dir, cfg)
    eos_token_ids, engine.eos_token_ids = engine.eos_token_ids, []  # no stop token: vLLM without a
    # tokenizer knows none of its own
    rows = range(len(PROMPTS))
    result = {"reference": asyncio.run(sample(VLLMRequestEngine(engine, cfg, partial_rollout=True), rows))}
    partial = VLLMRequestEngine(engine, cfg, partial_rollout=True)
    result["partial_seen"] = {}
    load_v1 = loader(engine, partial, model_dir, 1, result["partial_seen"])
    result["partial"] = asyncio.run(sample(partial, rows, load_v1, result["partial_seen"]))
    drain = VLLMRequestEngine(engine, cfg, partial_rollout=False)
    drain.policy_version = 1
    result["drain_seen"] = {}
    load_v2 = loader(engine, drain, model_dir, 2, result["drain_seen"])
    result["drain"] = asyncio.run(sample(drain, range(1), load_v2, result["drain_seen"]))
    result["drain_version"] = drain.policy_version
    engine.eos_token_ids = eos_token_ids  # batches: rows end at EOS, as in training
    result.update(batches_split_by_an_update(engine, model_dir))
    result.update(stop_split_by_the_update(model_dir, cfg))
    torch.save(result, out_file)
    print("OK partial-worker", flush=True)
    engine.shutdown()


def left_padded_prompts(seed: int) -> DataProto:
    width = max(map(len, PROMPTS))
    ids = torch.zeros(len(PROMPTS), width, dtype=torch.long)
    mask = torch.zeros(len(PROMPTS), width, dtype=torch.long)
    for row, prompt in enumerate(PROMPTS):
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    tensors = {"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(1) - 1).clamp(min=0)}
    return DataProto.from_dict(tensors, meta_info={"seed": seed})


def batches_split_by_an_update(engine: VLLMRolloutEngine, model_dir: str) -> dict:
    """The `batch_path`, `batches` and `batches_split` runs (tensors of each output batch)."""
    load_version(engine, model_dir, 0)
    out = {"batch_path": engine.generate_sequences(left_padded_prompts(seed=7)).batch.to_dict()}
    batches = RequestBatches(engine)
    out["batches"] = batches.generate_sequences(left_padded_prompts(seed=7)).batch.to_dict()
    frozen, release = threading.Event(), threading.Event()

    with ThreadPoolExecutor(max_workers=1) as caller:
        generating = caller.submit(batches.generate_sequences, left_padded_prompts(seed=7))

        async def hold_once_sampled() -> None:
            while not all_sampled(batches.requests, len(PROMPTS), SWITCH_AT):
                if generating.done():
                    raise RuntimeError(f"a row ended before every row sampled {SWITCH_AT} tokens")
                await asyncio.sleep(0)  # the engine steps between these checks
            out["batches_seen"] = [len(c.token_ids) for c in batches.requests.in_flight()]
            frozen.set()
            release.wait()  # holds the loop: nothing steps until the update is queued behind this

        holding = asyncio.run_coroutine_threadsafe(hold_once_sampled(), batches.loop)
        while not frozen.wait(timeout=1):  # a check, not a deadline: the hold failed or waits on
            if holding.done():
                holding.result()
        updated = batches.submit_update(lambda: load_version(engine, model_dir, 1))
        release.set()
        out["batches_split_version"] = updated.result()
        out["batches_split"] = generating.result().batch.to_dict()
    batches.shutdown()
    return out


def stop_split_by_the_update(model_dir: str, cfg: RolloutConfig) -> dict:
    """The `split` and `stop` runs, on an engine of their own (with a tokenizer)."""
    engine = VLLMRolloutEngine(model_dir, dataclasses.replace(cfg, val_sampling=SamplingConfig(stop=["\n"])))
    out = {"split_seen": {}}
    requests = VLLMRequestEngine(engine, cfg, partial_rollout=True)
    load_v1 = loader(engine, requests, model_dir, 1, out["split_seen"])
    (out["split"],) = asyncio.run(sample(requests, range(1), load_v1, out["split_seen"]))
    load_version(engine, model_dir, 0)
    boundary = len(engine.tokenizer.decode(out["split_seen"]["before"][0]))
    text = engine.tokenizer.decode(out["split"]["token_ids"])
    out["stop_string"] = text[boundary - 1 : boundary - 1 + STOP_CHARS]
    stop_sampling = dataclasses.replace(SAMPLING, stop=[out["stop_string"]])
    requests = VLLMRequestEngine(engine, cfg, partial_rollout=True)
    load_v1 = loader(engine, requests, model_dir, 1, {})
    (out["stop"],) = asyncio.run(sample(requests, range(1), load_v1, {}, stop_sampling))
    return out


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
