"""The rollout engine interface, and the response assembly the engines (hf, vllm, sglang) share.

Output of `generate_sequences(prompts)` for a batch of B prompt rows and n samples each (rows
repeated in place, `[a, a, b, b]`, non-tensor data repeated the same way), R = response_length:

| key | shape | meaning |
| --- | --- | --- |
| `prompts` | (B*n, P) | the input prompt ids, left-padded |
| `responses` | (B*n, R) | generated ids, right-padded with the pad id after EOS / a stop string |
| `response_mask` | (B*n, R) | 1 for generated tokens up to and including EOS (or the stop string's end) |
| `input_ids` | (B*n, P+R) | prompts then responses |
| `attention_mask` | (B*n, P+R) | prompt mask then response_mask |
| `position_ids` | (B*n, P+R) | prompt positions, then the last prompt position + 1, + 2, ... |
| `rollout_log_probs` | (B*n, R) | with `calculate_log_probs`: log p(token) at the rollout temperature |
| `rollout_top_k_ids` | (B*n, R, K) | with `top_k_log_probs` K > 0: the K likeliest ids, likeliest first |
| `rollout_top_k_log_probs` | (B*n, R, K) | their log-probs, in the distribution of `rollout_log_probs` |
| `prefill_tokens` | (B*n,) | vLLM: prompt tokens the engine took in for the row (over an agent's turns) |
| `prefix_cached_tokens` | (B*n,) | vLLM: of them, those its prefix cache served (whole KV blocks) |

The top-K tensors are 0 past each response's end.

meta_info switches read by the engines:
  - `validate: True` selects `val_sampling` instead of `sampling`;
  - `n`: samples per row, overriding the selected config's `n`. The PPO driver repeats the batch
    itself (`gen.repeat(n, interleave=True)`) and passes `n=1`;
  - `seed`: the sampling seed of this call. Without it a call uses its sampling position's seed
    (`SamplingPosition`: `rollout.seed + k` for the k-th training call, validation calls counted
    apart, so how often a run validates does not change what training samples);
    `get_rng_state()`/`set_rng_state()` save and restore the position, so a resumed run samples
    exactly as the uninterrupted one would have;
  - `rollout_seed_stream`: set by the sharding manager to the global rank, mixed into the seed so
    that slices of one batch generated on different ranks draw independent samples (the same
    prompt repeated across ranks must not get the same sample). Removed from the output by it.

The non-tensor column `rollout_row` (`ROW_KEY`), set by the rollout pool on the driver before a call
is split over its processes: each row's index in the whole call. The engine seeds the chunk's
rows as those rows of the call (`chunk_seed`), so a prompt's samples spread over several processes
are distinct, and the engines seeded per row (vllm, sglang, request batches) give each row the
same seed whatever the number of processes (the hf engine seeds its whole chunk with the chunk's
seed: its samples depend on the split). The column is removed before generating: it never
reaches the output.
"""

from collections.abc import Iterable
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import torch

from engines.rollout.config import RolloutConfig, SamplingConfig
from hybridflow.protocol import DataProto, answer_meta

PROMPT_KEYS = ("input_ids", "attention_mask", "position_ids")
# Memory an engine can release and resume separately (SGLang's tags, sglang/srt/constants.py).
WEIGHTS_TAG, KV_CACHE_TAG, CUDA_GRAPH_TAG = "weights", "kv_cache", "cuda_graph"
SEED_STREAM_KEY = "rollout_seed_stream"
PREFILL_KEY, CACHED_KEY = "prefill_tokens", "prefix_cached_tokens"  # per row, from engines that count them
REPLICA_KEY = "rollout_replica"  # (B,): the rollout pool process that generated each row (its rank)
ROW_KEY = "rollout_row"  # non-tensor column: each row's index in its generation call
_SEED_MODULUS = 2**62
_VALIDATION_STREAM = 2**31 - 1  # mixed into validation calls' seeds, apart from training's base + k
_MULTIPLIER = 1_000_003  # prime: keeps (seed, other) pairs apart in _mix_seeds
_MULTIPLIER_INVERSE = pow(_MULTIPLIER, -1, _SEED_MODULUS)


class TopK(NamedTuple):
    """The engine's K likeliest tokens at each generated position, likeliest first."""

    ids: torch.Tensor  # (B, L, K) int64
    log_probs: torch.Tensor  # (B, L, K) float32, of the distribution the token was sampled from


class RolloutEngine(Protocol):
    """What the sharding manager and the rollout worker call on an engine."""

    def generate_sequences(self, prompts: DataProto) -> DataProto: ...

    def begin_weight_update(self) -> None:
        """Open a weight-update session (SGLang refuses updates outside one)."""

    def end_weight_update(self) -> None: ...

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load full Hugging Face-named tensors in place; an unknown name or shape is an error."""

    def flush_cache(self) -> None:
        """Drop cached KV computed with the previous weights (called once after a sync)."""

    def weight_checksums(self, names: list[str] | None = None) -> dict[str, str]:
        """`tensor_checksum` of the named parameters (all of them when `names` is None)."""

    def release_memory(self, tags: list[str] | None = None) -> None:
        """Free the tagged memory (None: all of it) for the actor; see the sharding manager."""

    def resume_memory(self, tags: list[str] | None = None) -> None: ...

    def get_rng_state(self) -> dict[str, Any]: ...

    def set_rng_state(self, state: dict[str, Any]) -> None: ...

    def shutdown(self) -> None:
        """Stop the engine's processes and free what it holds (the worker's teardown calls it)."""


class SeededGenerationMixin:
    """`generate_sequences` and the RNG state shared by the engines.

    An engine sets `cfg`, `eos_token_ids`, `pad_token_id`, `tokenizer` (None unless stop strings
    are used) and `position = SamplingPosition()`, and implements `_generate(prompts, sampling,
    seed)` returning the generated ids (B, L), their log-probs (B, L) or None, and with
    `top_k_log_probs` K > 0 their `TopK` (B, L, K) (else None), on CPU; an engine that counts its
    prefix-cache hits (vLLM) adds each row's prefilled and cached prompt tokens (two lists of B).
    """

    cfg: RolloutConfig
    eos_token_ids: list[int]
    pad_token_id: int
    tokenizer: Any
    position: "SamplingPosition"

    def _generate(self, prompts: DataProto, sampling: SamplingConfig, seed: int):
        raise NotImplementedError

    def generate_sequences(self, prompts: DataProto) -> DataProto:
        prompts, sampling, seed = self.start_call(prompts)
        responses, log_probs, top_k, *prefill = self._generate(prompts, sampling, seed)
        output = assemble_rollout_output(
            prompts,
            responses,
            eos_token_ids=self.eos_token_ids,
            pad_token_id=self.pad_token_id,
            response_length=self.cfg.response_length,
            stop=sampling.stop,
            tokenizer=self.tokenizer,
            log_probs=log_probs,
            top_k=top_k,
        )
        return with_prefill_counts(output, *prefill) if prefill else output

    def start_call(self, prompts: DataProto) -> tuple[DataProto, SamplingConfig, int]:
        """Check the prompts and pick this call's sampling and seed (counting the call); the rows
        repeated n times when the sampling asks for n samples each."""
        check_prompts(prompts)
        sampling, n = select_sampling(self.cfg, prompts.meta_info)
        default_seed = self.position.next_seed(self.cfg.seed, is_validation(prompts.meta_info))
        seed = call_seed(prompts.meta_info, default_seed)
        prompts, first_row = without_row_index(prompts)
        if n > 1:
            prompts = prompts.repeat(n, interleave=True)
        return prompts, sampling, chunk_seed(seed, first_row * n)

    def get_rng_state(self) -> dict[str, int]:
        return self.position.state()

    def set_rng_state(self, state: dict[str, Any]) -> None:
        self.position = SamplingPosition.from_state(state)


class SamplingPosition:
    """How many training and validation calls came before: the default seed of the next call.

    The two kinds count apart, and validation seeds are mixed away from training's, so validating
    more or less often (`trainer.test_freq`, ReMax's greedy baselines) leaves training's samples as
    they were."""

    def __init__(self, calls: int = 0, val_calls: int = 0):
        self.calls, self.val_calls = calls, val_calls

    def next_seed(self, base_seed: int, validate: bool) -> int:
        """The next call's seed (counting it): base_seed + k for the k-th training call."""
        if validate:
            self.val_calls += 1
            return _mix_seeds(base_seed + self.val_calls - 1, _VALIDATION_STREAM)
        self.calls += 1
        return base_seed + self.calls - 1

    def state(self) -> dict[str, int]:
        return {"calls": self.calls, "val_calls": self.val_calls}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> "SamplingPosition":
        """The inverse of `state()`; a state without `val_calls` (saved before validation calls
        counted apart) starts them at 0."""
        saved = state if isinstance(state, dict) else {}
        counts = {"calls": saved.get("calls"), "val_calls": saved.get("val_calls", 0)}
        if not all(map(_is_count, counts.values())):
            expected = "{'calls': int >= 0, 'val_calls': int >= 0 (0 when absent)}"
            raise ValueError(f"set_rng_state expects {expected}, got {state!r}")
        return cls(**counts)

    def advanced_to(self, other: "SamplingPosition") -> "SamplingPosition":
        """The later of the two positions, per kind of call."""
        return SamplingPosition(max(self.calls, other.calls), max(self.val_calls, other.val_calls))


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def is_validation(meta_info: dict) -> bool:
    return bool(meta_info.get("validate", False))


def select_sampling(cfg: RolloutConfig, meta_info: dict) -> tuple[SamplingConfig, int]:
    """The sampling settings of this call and the number of samples per prompt row."""
    sampling = cfg.val_sampling if is_validation(meta_info) else cfg.sampling
    n = meta_info.get("n", sampling.n)
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"meta_info['n'] must be a positive int (samples per prompt), got {n!r}")
    return sampling, n


def call_seed(meta_info: dict, default_seed: int) -> int:
    """The sampling seed of one call: meta_info["seed"] when given, else default_seed (the sampling
    position's), mixed with the seed stream when one is given."""
    seed = meta_info.get("seed", default_seed)
    stream = meta_info.get(SEED_STREAM_KEY, 0)
    for key, value in (("seed", seed), (SEED_STREAM_KEY, stream)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"meta_info[{key!r}] must be an int, got {value!r}")
    if stream == 0:
        return seed
    return _mix_seeds(seed, stream)


def row_seed(call_seed: int, row: int) -> int:
    """The sampling seed of row `row` of a call, for engines seeded per request: distinct rows get
    distinct seeds, and every seed stays below 2**62 (engines keep seeds in int64)."""
    return _mix_seeds(call_seed, row + 1)


def chunk_seed(call_seed: int, first_row: int) -> int:
    """The seed of a chunk of a call whose first row is the call's row `first_row`: the chunk's
    row j gets row_seed(call_seed, first_row + j). row_seed is affine in the row modulo 2**62 with
    an odd multiplier, which has an inverse there, so the shift of rows is one of seeds. A chunk
    at row 0 keeps the call's seed as given (the hf engine seeds torch with it)."""
    if first_row == 0:
        return call_seed
    return (call_seed + first_row * _MULTIPLIER_INVERSE) % _SEED_MODULUS


def without_row_index(prompts: DataProto) -> tuple[DataProto, int]:
    """The prompts without the `ROW_KEY` column (views) and the call's index of their first row
    (0 without the column). Dispatch's padding rows come after a chunk's own rows, so the first row
    is always the chunk's own."""
    if ROW_KEY not in prompts.non_tensor_batch:
        return prompts, 0
    prompts = prompts.slice()  # the caller's rows keep their column
    rows = prompts.non_tensor_batch.pop(ROW_KEY)
    return prompts, int(rows[0]) if len(rows) else 0


def _mix_seeds(seed: int, other: int) -> int:
    return (seed * _MULTIPLIER + other) % _SEED_MODULUS


def check_prompts(prompts: DataProto) -> None:
    """Raise ValueError unless `prompts` holds left-padded (B, P) prompt tensors."""
    if prompts.batch is None:
        raise ValueError(f"generate_sequences needs tensors {PROMPT_KEYS}, got a DataProto without tensors")
    missing = [k for k in PROMPT_KEYS if k not in prompts.batch]
    if missing:
        raise ValueError(f"generate_sequences needs prompt tensors {PROMPT_KEYS}; missing {missing}")
    shape = prompts.batch["input_ids"].shape
    for key in PROMPT_KEYS:
        if prompts.batch[key].dim() != 2 or prompts.batch[key].shape != shape:
            raise ValueError(
                f"prompt tensor {key!r} has shape {tuple(prompts.batch[key].shape)}, expected {tuple(shape)}"
            )
    mask = prompts.batch["attention_mask"]
    if len(prompts) and not (mask[:, -1] == 1).all():
        raise ValueError("prompts must be left-padded: attention_mask[:, -1] must be 1 on every row")
    if not (mask[:, 1:] >= mask[:, :-1]).all():
        raise ValueError("prompts must be left-padded: attention_mask must be 0s then 1s on each row")


def unpadded_prompts(prompts: DataProto) -> list[list[int]]:
    """Each prompt row's token ids without its left padding."""
    ids, mask = prompts.batch["input_ids"], prompts.batch["attention_mask"]  # (B, P)
    return [row[row_mask.bool()].tolist() for row, row_mask in zip(ids, mask, strict=True)]


def pad_rows(rows: list[list], pad_value, dtype: torch.dtype) -> torch.Tensor:
    """Rows of different lengths right-padded to the longest with `pad_value`. -> (B, L)"""
    padded = torch.full((len(rows), max(map(len, rows), default=0)), pad_value, dtype=dtype)
    for index, row in enumerate(rows):
        padded[index, : len(row)] = torch.tensor(row, dtype=dtype)
    return padded


def response_mask_until_eos(responses: torch.Tensor, eos_token_ids: list[int]) -> torch.Tensor:
    """1 for each token up to and including the first EOS of its row, 0 after it. (B, L) -> (B, L)."""
    is_eos = torch.isin(responses, torch.tensor(eos_token_ids, device=responses.device))  # (B, L)
    eos_before = is_eos.long().cumsum(dim=1) - is_eos.long()  # EOS count strictly before each token
    return (eos_before == 0).long()


def stop_string_lengths(
    responses: torch.Tensor, mask: torch.Tensor, tokenizer, stops: list[str]
) -> torch.Tensor:
    """Per row, the number of tokens up to and including the one that completes the first stop
    string; rows without a stop string keep their masked length. (B, L) -> (B,)."""
    lengths = mask.sum(dim=1)  # (B,)
    for row in range(responses.shape[0]):
        ids = responses[row, : int(lengths[row])].tolist()
        if not _has_stop(tokenizer.decode(ids), stops):
            continue
        # A decoded prefix only grows, so "contains a stop string" is monotone in the prefix length.
        low, high = 1, len(ids)
        while low < high:
            middle = (low + high) // 2
            if _has_stop(tokenizer.decode(ids[:middle]), stops):
                high = middle
            else:
                low = middle + 1
        lengths[row] = low
    return lengths


def _has_stop(text: str, stops: list[str]) -> bool:
    return any(stop in text for stop in stops)


def with_prefill_counts(output: DataProto, prefilled: list[int], cached: list[int]) -> DataProto:
    """`output` with each row's prompt tokens the engine took in and how many of them its prefix
    cache served (`PREFILL_KEY`, `CACHED_KEY`, (B,) each): the step's prefix-cache hit rate."""
    output.batch[PREFILL_KEY] = torch.tensor(prefilled, dtype=torch.long)
    output.batch[CACHED_KEY] = torch.tensor(cached, dtype=torch.long)
    return output


def assemble_rollout_output(
    prompts: DataProto,
    responses: torch.Tensor,
    *,
    eos_token_ids: list[int],
    pad_token_id: int,
    response_length: int,
    stop: list[str],
    tokenizer=None,
    log_probs: torch.Tensor | None = None,
    top_k: TopK | None = None,
) -> DataProto:
    """Build the `generate_sequences` output from raw generated ids.

    `responses` (B, L), L <= response_length, holds each row's generated ids; tokens after a row's
    first EOS (or after its first stop string, when `stop` is given) are masked and set to the pad
    id. `log_probs` (B, L) are the chosen tokens' log-probs, or None; `top_k` (B, L, K) the
    likeliest tokens at each position, or None.
    """
    batch_size, length = responses.shape
    if length > response_length:
        raise ValueError(f"generated {length} tokens, more than rollout.response_length={response_length}")
    if batch_size != len(prompts):
        raise ValueError(f"got {batch_size} response rows for {len(prompts)} prompt rows")
    mask = response_mask_until_eos(responses, eos_token_ids)  # (B, L)
    if stop:
        if tokenizer is None:
            raise ValueError(f"stop strings {stop} need the model's tokenizer, but the engine has none")
        keep = stop_string_lengths(responses, mask, tokenizer, stop)  # (B,)
        mask = mask * (torch.arange(length, device=mask.device)[None, :] < keep[:, None]).long()
    padding = response_length - length
    responses = torch.nn.functional.pad(
        responses.masked_fill(mask == 0, pad_token_id), (0, padding), value=pad_token_id
    )  # (B, R)
    mask = torch.nn.functional.pad(mask, (0, padding), value=0)  # (B, R)

    prompt_ids = prompts.batch["input_ids"]  # (B, P)
    prompt_positions = prompts.batch["position_ids"]  # (B, P)
    steps = torch.arange(1, response_length + 1, device=prompt_positions.device)  # (R,)
    response_positions = prompt_positions[:, -1:] + steps[None, :]  # (B, R)
    tensors = {
        "prompts": prompt_ids,
        "responses": responses,
        "response_mask": mask,
        "input_ids": torch.cat([prompt_ids, responses], dim=1),
        "attention_mask": torch.cat([prompts.batch["attention_mask"], mask], dim=1),
        "position_ids": torch.cat([prompt_positions, response_positions], dim=1),
    }
    if log_probs is not None:
        log_probs = torch.nn.functional.pad(
            log_probs.float() * mask[:, :length], (0, padding), value=0.0
        )  # (B, R)
        tensors["rollout_log_probs"] = log_probs
    if top_k is not None:
        tensors.update(_padded_top_k(top_k, mask))
    return DataProto.from_dict(
        tensors=tensors, non_tensors=prompts.non_tensor_batch, meta_info=answer_meta(prompts.meta_info)
    )


def _padded_top_k(top_k: TopK, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """The top-K tensors of the output, 0 past each response's end. `mask` is (B, R)."""
    length = top_k.ids.shape[1]
    padding = (0, 0, 0, mask.shape[1] - length)  # the position dimension, from L to R
    outside = (mask[:, :length] == 0)[..., None]  # (B, L, 1)
    # masked_fill, not a product: vLLM's processed log-probs are -inf outside top-k / top-p filters
    ids = top_k.ids.long().masked_fill(outside, 0)  # (B, L, K)
    log_probs = top_k.log_probs.float().masked_fill(outside, 0.0)  # (B, L, K)
    return {
        "rollout_top_k_ids": torch.nn.functional.pad(ids, padding),  # (B, R, K)
        "rollout_top_k_log_probs": torch.nn.functional.pad(log_probs, padding),  # (B, R, K)
    }


def read_special_token_ids(model_path: Path, hf_config) -> tuple[list[int], int]:
    """EOS ids (generation_config.json first, then config.json) and the pad id (EOS if none)."""
    from transformers import GenerationConfig

    try:
        generation = GenerationConfig.from_pretrained(model_path)
    except OSError:
        generation = GenerationConfig.from_model_config(hf_config)
    eos = generation.eos_token_id if generation.eos_token_id is not None else hf_config.eos_token_id
    if eos is None:
        raise ValueError(f"{model_path}: neither generation_config.json nor config.json sets eos_token_id")
    eos_ids = [eos] if isinstance(eos, int) else list(eos)
    pad = generation.pad_token_id if generation.pad_token_id is not None else hf_config.pad_token_id
    return eos_ids, eos_ids[0] if pad is None else int(pad)


def load_tokenizer(model_path: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_path)
    except (OSError, ValueError) as err:
        raise ValueError(
            f"stop strings need a tokenizer in {model_path}, and loading it failed: {err}"
        ) from err
