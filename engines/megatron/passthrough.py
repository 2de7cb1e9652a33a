"""Recipe sections that reach Megatron-Core's config dataclasses by their own names:
`<role>.megatron.transformer` -> `TransformerConfig`, `.ddp` -> `DistributedDataParallelConfig`,
`.optimizer` -> `OptimizerConfig` (megatron-core 0.16.1). hybridflow builds each config from the
model's config.json and its typed settings, then these sections override it field by field.

`check_megatron_passthrough` runs when the recipe loads (MegatronConfig.__post_init__) and imports
Megatron-Core only when a section is set, so `import hybridflow` stays light. A few values that
would make hybridflow read wrong weights (`REFUSED`) are refused with the reason.
"""

import dataclasses
import types
import typing

from engines.passthrough import check_setting_names

FROM_MODEL = "the model's config.json"
FROM_DTYPE = "megatron.params_dtype"
FROM_CUDA = "whether CUDA is present"

TRANSFORMER_SET_ELSEWHERE = {
    **dict.fromkeys(
        (
            "num_layers",
            "hidden_size",
            "ffn_hidden_size",
            "num_attention_heads",
            "num_query_groups",
            "kv_channels",
            "normalization",
            "layernorm_epsilon",
            "gated_linear_unit",
            "activation_func",
            "add_bias_linear",
            "add_qkv_bias",
            "init_method_std",
        ),
        FROM_MODEL,
    ),
    **{
        name: f"megatron.{name}"
        for name in (
            "tensor_model_parallel_size",
            "pipeline_model_parallel_size",
            "context_parallel_size",
            "sequence_parallel",
        )
    },
    **dict.fromkeys(("params_dtype", "pipeline_dtype", "bf16", "fp16"), FROM_DTYPE),
    "use_cpu_initialization": FROM_CUDA,
}
DDP_SET_ELSEWHERE = {"use_distributed_optimizer": "megatron.use_distributed_optimizer"}
OPTIMIZER_SET_ELSEWHERE = {
    **{
        name: f"optim.{name}"
        for name in ("optimizer", "lr", "min_lr", "weight_decay", "adam_beta1", "adam_beta2", "adam_eps")
    },
    "clip_grad": "optim.clip_grad",
    **dict.fromkeys(("params_dtype", "bf16", "fp16"), FROM_DTYPE),
    "use_distributed_optimizer": "megatron.use_distributed_optimizer",
}


# Megatron-Core settings hybridflow cannot honour: (section, name) -> (refused value, why and the fix).
REFUSED = {
    ("ddp", "overlap_param_gather"): (
        True,
        "with the distributed optimizer it defers the all-gather of the updated parameters from "
        "optimizer.step() to the next forward (megatron/core/optimizer/distrib_optimizer.py 2613-2619), "
        "but hybridflow reads the parameters before that: the weight sync into the rollout engine, "
        "checkpoints and the Hugging Face export would see stale or mixed weights; set it to false",
    ),
}


def _config_classes() -> dict[str, tuple[type, dict[str, str]]]:
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.transformer import TransformerConfig

    return {
        "transformer": (TransformerConfig, TRANSFORMER_SET_ELSEWHERE),
        "ddp": (DistributedDataParallelConfig, DDP_SET_ELSEWHERE),
        "optimizer": (OptimizerConfig, OPTIMIZER_SET_ELSEWHERE),
    }


def check_megatron_passthrough(sections: dict[str, dict]) -> None:
    """ValueError naming `megatron.<section>.<name>` for a name that is not a field of the Megatron-Core
    class, one hybridflow sets itself, or a value whose type the field does not take."""
    if not any(sections.values()):
        return
    for section, (cls, set_elsewhere) in _config_classes().items():
        settings = sections[section]
        key = f"megatron.{section}"
        check_setting_names(
            key, settings, [f.name for f in dataclasses.fields(cls)], cls.__name__, set_elsewhere
        )
        hints = typing.get_type_hints(cls)
        for name, value in settings.items():
            if not _accepts(hints[name], value):
                raise ValueError(f"{key}.{name}={value!r}: {cls.__name__}.{name} takes {hints[name]}")
            refused, why = REFUSED.get((section, name), (None, ""))
            if refused is not None and value == refused:
                raise ValueError(f"{key}.{name}={value!r} is not supported: {why}")


def _accepts(hint, value) -> bool:
    """Whether a YAML value fits a field annotation; types a recipe cannot write (callables,
    torch dtypes, enums) accept nothing."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is typing.Any:
        return True
    if hint is type(None):
        return value is None
    if origin in (typing.Union, types.UnionType):
        return any(_accepts(arg, value) for arg in args)
    if origin is typing.Literal:
        return value in args
    if origin in (list, tuple):
        return isinstance(value, list | tuple) and (not args or all(_accepts(args[0], v) for v in value))
    if origin is dict:
        return isinstance(value, dict)
    if hint is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint in (bool, str):
        return isinstance(value, hint)
    return False
