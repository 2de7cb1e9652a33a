"""Hugging Face config -> Megatron-Core `TransformerConfig` -> `GPTModel` chunks for this pipeline stage.

Supported architectures: Llama, Qwen2 (which covers Qwen2.5) and Qwen3: RMSNorm, SwiGLU MLP, RoPE,
grouped-query attention, optional QKV bias, QK layernorm (Qwen3), tied or untied embeddings; and
the mixture-of-experts Qwen3-MoE and Mixtral: every layer's MLP is Megatron-Core's MoE layer
(top-k softmax router with the HF model's top-k normalisation, dropless, no shared experts).
Experts are Megatron's SequentialMLP (and the all-gather / all-to-all token dispatchers) on CPU,
TE's grouped GEMM when Transformer Engine runs on CUDA.

Kernels (`model_kernels`, a plain function of what the machine has, so CPU tests check the CUDA
choice): with CUDA and Transformer Engine, Megatron-Core's TE layer spec with TE's flash / cuDNN
core attention (te_attention.py), TE's final norm and the fused kernels (RoPE, SwiGLU, bias-dropout-
add; weight-gradient accumulation where apex's extension is built); otherwise Megatron-Core's local
spec with `SDPACoreAttention` (attention.py), no fusions, and torch's norms everywhere (Megatron
would pick apex's FusedLayerNorm for the final norm when apex is installed, and it refuses RMSNorm).

`build_gpt_model(..., value_head=True)` (build.py's `build_model` calls it) replaces the vocabulary
output layer with a replicated `hidden -> 1` linear (critics, reward models): loaded from
`score.weight` when the checkpoint has one (a `*ForSequenceClassification` export), else freshly
initialised.
"""

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engines.megatron import cpu_compat
from engines.megatron.config import MegatronConfig

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "LlamaForSequenceClassification": "llama",
    "Qwen2ForSequenceClassification": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3ForSequenceClassification": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen3MoeForSequenceClassification": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
    "MixtralForSequenceClassification": "mixtral",
}
MOE_FAMILIES = ("qwen3_moe", "mixtral")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
REQUIRED_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
)


@dataclass(frozen=True)
class HFModelConfig:
    """The fields of a Hugging Face config.json that the Megatron model needs (plus the raw dict)."""

    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    initializer_range: float = 0.02
    source_dir: str = ""
    qk_layernorm: bool = False  # Qwen3: RMSNorm over each head's queries and keys
    num_experts: int = 0  # 0: dense MLP; else every layer is a mixture of experts
    moe_router_topk: int = 0
    moe_ffn_hidden_size: int = 0  # one expert's intermediate size
    norm_topk_prob: bool = True  # renormalise the top-k router probabilities to sum to 1
    raw: dict = field(default_factory=dict, repr=False, compare=False)


def rope_theta_of(raw: dict, where: str) -> float:
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise ValueError(f"{where}: rope type {rope_type!r} is not supported (only 'default' RoPE)")
    theta = params.get("rope_theta", raw.get("rope_theta"))
    if theta is None:
        raise ValueError(f"{where}: no rope_theta in config.json (top level or rope_parameters)")
    return float(theta)


def check_unsupported_features(raw: dict, family: str, where: str) -> None:
    if raw.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{where}: hidden_act {raw['hidden_act']!r} is not supported (expected 'silu')")
    if family == "llama" and (raw.get("attention_bias") or raw.get("mlp_bias")):
        raise ValueError(f"{where}: Llama with attention_bias or mlp_bias is not supported")
    if family in ("qwen2", "qwen3", "qwen3_moe") and raw.get("use_sliding_window"):
        raise ValueError(f"{where}: {family} sliding-window attention is not supported")
    if family == "mixtral" and raw.get("sliding_window"):
        raise ValueError(f"{where}: Mixtral sliding-window attention is not supported (sliding_window=null)")
    if family in ("qwen3", "qwen3_moe") and raw.get("attention_bias"):
        raise ValueError(f"{where}: {family} with attention_bias is not supported")
    if family == "qwen3_moe" and (raw.get("mlp_only_layers") or raw.get("decoder_sparse_step", 1) != 1):
        raise ValueError(
            f"{where}: Qwen3-MoE with dense layers (mlp_only_layers / decoder_sparse_step != 1) is not "
            "supported: every layer must be a mixture of experts"
        )


def _moe_fields(raw: dict, family: str, where: str) -> dict:
    """HFModelConfig's expert fields: Qwen3-MoE and Mixtral name them differently."""
    if family not in MOE_FAMILIES:
        return {}
    experts = raw.get("num_experts") or raw.get("num_local_experts")
    topk = raw.get("num_experts_per_tok")
    if not experts or not topk or topk > experts:
        raise ValueError(f"{where}: need 1 <= num_experts_per_tok <= num_experts, got {topk} and {experts}")
    return dict(
        num_experts=experts,
        moe_router_topk=topk,
        # Mixtral's experts are intermediate_size wide and always renormalise the top-k.
        moe_ffn_hidden_size=raw["moe_intermediate_size"]
        if family == "qwen3_moe"
        else raw["intermediate_size"],
        norm_topk_prob=bool(raw.get("norm_topk_prob", False)) if family == "qwen3_moe" else True,
    )


def load_hf_config(path) -> HFModelConfig:
    """Read `<path>/config.json`; ValueError naming the architecture if it is not supported."""
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        raise ValueError(f"no config.json in Hugging Face model directory {path}")
    try:
        raw = json.loads(config_file.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{config_file} is not valid JSON ({err})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{config_file} must hold a JSON object, got {type(raw).__name__}")
    if "vision_config" in raw:  # its text fields sit under text_config: the missing-field list would mislead
        names = ", ".join(raw.get("architectures") or ["the model"])
        raise ValueError(
            f"{config_file}: {names} is a vision-language model; it trains only as the policy, read by "
            "engines/megatron/vlm_config.load_vlm_config (docs/vlm.md); this role needs a text model"
        )
    missing = [key for key in REQUIRED_FIELDS if key not in raw]
    if missing:
        raise ValueError(f"{config_file} lacks {missing}, which the Megatron model needs")
    architectures = raw.get("architectures") or []
    if len(architectures) != 1 or architectures[0] not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"{config_file}: unsupported architecture {architectures}; supported: "
            f"{sorted(SUPPORTED_ARCHITECTURES)}"
        )
    architecture = architectures[0]
    family = SUPPORTED_ARCHITECTURES[architecture]
    check_unsupported_features(raw, family, str(config_file))
    return HFModelConfig(
        architecture=architecture,
        model_type=raw.get("model_type", family),
        **dense_text_fields(raw, family, str(config_file)),
        source_dir=str(Path(path).resolve()),
        raw=raw,
        qk_layernorm=family in ("qwen3", "qwen3_moe"),
        **_moe_fields(raw, family, str(config_file)),
    )


def dense_text_fields(raw: dict, family: str, where: str) -> dict:
    """The `HFModelConfig` fields every supported language model has, from its config.json (a
    text model's, or a vision-language model's `text_config`)."""
    heads = raw["num_attention_heads"]
    return dict(
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        num_hidden_layers=raw["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=raw.get("num_key_value_heads") or heads,
        head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        rope_theta=rope_theta_of(raw, where),
        max_position_embeddings=raw.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=family == "qwen2",
        initializer_range=raw.get("initializer_range", 0.02),
    )


def padded_vocab_size(vocab_size: int, cfg: MegatronConfig) -> int:
    """Vocabulary rounded up to a multiple of make_vocab_size_divisible_by x TP (Megatron's rule)."""
    multiple = cfg.make_vocab_size_divisible_by * cfg.tensor_model_parallel_size
    return -(-vocab_size // multiple) * multiple


def params_dtype(cfg: MegatronConfig) -> torch.dtype:
    if cfg.params_dtype not in DTYPES:
        raise ValueError(f"params_dtype must be one of {sorted(DTYPES)}, got {cfg.params_dtype!r}")
    return DTYPES[cfg.params_dtype]


def _importable(module: str) -> bool:
    try:
        __import__(module)
    except ImportError:
        return False
    return True


def transformer_engine_usable() -> bool:
    """Whether Transformer Engine's torch layers import. `import transformer_engine` is not
    enough: its `__init__` swallows a failed `from . import pytorch` (transformer_engine 2.20.2
    `__init__.py` 84-108), so the core library alone imports while TENorm and the TE layer spec
    do not. A missing torch extension fails as ImportError or as FileNotFoundError (its shared
    object)."""
    try:
        import transformer_engine.pytorch  # noqa: F401
    except (ImportError, FileNotFoundError):
        return False
    return True


@dataclass(frozen=True)
class ModelKernels:
    """Which Megatron-Core implementation the model layers use."""

    transformer_engine: bool  # TE layer spec, TE core attention, TE final norm
    fused_wgrad: bool  # gradient_accumulation_fusion (apex's fused_weight_gradient_mlp_cuda)


def model_kernels(cuda: bool, transformer_engine: bool, apex_wgrad_extension: bool) -> ModelKernels:
    """TE only where it can run (CUDA); weight-gradient fusion also needs apex's CUDA extension,
    which Megatron's local output layer calls even under the TE spec."""
    te = cuda and transformer_engine
    return ModelKernels(transformer_engine=te, fused_wgrad=te and apex_wgrad_extension)


def machine_kernels() -> ModelKernels:
    """`model_kernels` for this process."""
    cuda = cpu_compat.cuda_available()
    return model_kernels(
        cuda,
        cuda and transformer_engine_usable(),
        cuda and _importable("fused_weight_gradient_mlp_cuda"),
    )


def use_transformer_engine() -> bool:
    """Transformer Engine layers only where they can run: TE importable and CUDA present."""
    return machine_kernels().transformer_engine


def fusion_settings(kernels: ModelKernels) -> dict[str, bool]:
    """Megatron-Core's fused-kernel switches: on with Transformer Engine, off without (each needs
    CUDA and TE or apex). The models here have no biases; the bias fusions are SwiGLU and the
    residual add. `masked_softmax_fusion` belongs to the local DotProductAttention, never used."""
    te = kernels.transformer_engine
    return dict(
        gradient_accumulation_fusion=kernels.fused_wgrad,
        bias_activation_fusion=te,
        bias_dropout_fusion=te,
        apply_rope_fusion=te,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
    )


def to_transformer_config(hf_config: HFModelConfig, cfg: MegatronConfig):
    """Megatron-Core TransformerConfig for this HF model and parallel layout."""
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig

    dtype = params_dtype(cfg)
    if cfg.sequence_parallel and not use_transformer_engine():
        raise ValueError("sequence_parallel=True needs Transformer Engine on CUDA; set it to false")
    settings = dict(
        num_layers=hf_config.num_hidden_layers,
        hidden_size=hf_config.hidden_size,
        ffn_hidden_size=hf_config.intermediate_size,
        num_attention_heads=hf_config.num_attention_heads,
        num_query_groups=hf_config.num_key_value_heads,
        kv_channels=hf_config.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=hf_config.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=hf_config.qkv_bias,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=hf_config.initializer_range,
        tensor_model_parallel_size=cfg.tensor_model_parallel_size,
        pipeline_model_parallel_size=cfg.pipeline_model_parallel_size,
        context_parallel_size=cfg.context_parallel_size,
        sequence_parallel=cfg.sequence_parallel,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        attention_softmax_in_fp32=True,
        **fusion_settings(machine_kernels()),
        variable_seq_lengths=False,
        qk_layernorm=hf_config.qk_layernorm,
        **moe_config(hf_config, cfg),
        **cpu_compat.transformer_config_overrides(),
    )
    return TransformerConfig(**{**settings, **cfg.transformer})  # the recipe's pass-through wins


def moe_config(hf_config: HFModelConfig, cfg: MegatronConfig) -> dict:
    """TransformerConfig's MoE settings: HF's router, dropless, Megatron's aux loss (empty if dense)."""
    if not hf_config.num_experts:
        return {}
    return dict(
        num_moe_experts=hf_config.num_experts,
        moe_router_topk=hf_config.moe_router_topk,
        moe_ffn_hidden_size=hf_config.moe_ffn_hidden_size,
        # top-k of the logits then softmax over the k == HF's softmax, top-k, renormalise;
        # pre-softmax keeps the full-softmax probabilities (HF's norm_topk_prob=False).
        moe_router_pre_softmax=not hf_config.norm_topk_prob,
        moe_router_score_function="softmax",
        moe_router_dtype="fp32",
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=cfg.moe_aux_loss_coeff,
        moe_expert_capacity_factor=None,  # dropless: every token reaches its k experts
        moe_token_dispatcher_type=cfg.moe_token_dispatcher_type,
        moe_enable_routing_replay=cfg.moe_routing_replay == "rollout",  # routing_replay.py
        moe_grouped_gemm=use_transformer_engine(),
        moe_permute_fusion=False,
        expert_model_parallel_size=cfg.expert_model_parallel_size,
        expert_tensor_parallel_size=expert_tp_size(cfg),
    )


def expert_tp_size(cfg: MegatronConfig) -> int:
    """Expert tensor-parallel size; None in the config means Megatron's default, the dense TP size."""
    if cfg.expert_tensor_parallel_size is None:
        return cfg.tensor_model_parallel_size
    return cfg.expert_tensor_parallel_size


def layer_spec(hf_config: HFModelConfig, kernels: ModelKernels):
    """GPT layer spec: Transformer Engine's (TE core attention that also takes hybridflow's padding
    mask) or Megatron-Core's local one with the SDPA core attention; QK layernorm and MoE layers
    (grouped GEMM experts with TE, sequential ones without) per model."""
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )

    num_experts = hf_config.num_experts or None
    qk_layernorm = hf_config.qk_layernorm
    if kernels.transformer_engine:
        from engines.megatron.te_attention import te_core_attention

        spec = get_gpt_layer_with_transformer_engine_spec(
            num_experts=num_experts, moe_grouped_gemm=num_experts is not None, qk_layernorm=qk_layernorm
        )
        spec.submodules.self_attention.submodules.core_attention = te_core_attention()
        return spec
    from engines.megatron.attention import SDPACoreAttention

    spec = get_gpt_layer_local_spec(
        num_experts=num_experts, qk_layernorm=qk_layernorm, normalization="RMSNorm"
    )
    spec.submodules.self_attention.submodules.core_attention = SDPACoreAttention
    return spec


def block_spec(hf_config: HFModelConfig, tf_config, kernels: ModelKernels):
    """This pipeline stage's layers and the final norm, chosen here rather than by Megatron's
    module-level default (apex's FusedLayerNorm whenever apex imports, which asserts LayerNorm)."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )

    if kernels.transformer_engine:
        from megatron.core.extensions.transformer_engine import TENorm as final_norm
    else:
        final_norm = WrappedTorchNorm
    layers = [layer_spec(hf_config, kernels)] * get_num_layers_to_build(tf_config)
    return TransformerBlockSubmodules(layer_specs=layers, layer_norm=final_norm)


class ValueHead(torch.nn.Linear):
    """hidden -> 1 scalar head, replicated on every tensor-parallel rank (GPTModel's output-layer call)."""

    def __init__(self, hidden_size: int, init_std: float, seed: int, dtype: torch.dtype):
        super().__init__(hidden_size, 1, bias=False, dtype=dtype)
        # A fixed generator makes every TP/DP replica start from the same head.
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            self.weight.copy_(torch.randn(self.weight.shape, generator=gen) * init_std)

    def forward(self, hidden_states, weight=None, runtime_gather_output=None):
        return super().forward(hidden_states), None  # (s, b, 1)


def unwrap_model(chunk):
    """The GPTModel inside DDP / Float16Module wrappers."""
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def parameters_in_dtype(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Casts every floating-point parameter to `dtype` (buffers keep theirs, e.g. the MoE router's
    fp32 expert bias), as Megatron's `Float16Module`, which hybridflow does not wrap, casts the model.
    Megatron-Core builds some modules without `params_dtype`: the local spec's torch norms
    (`WrappedTorchNorm`, in the LLaVA's tower too; fp32 there made `torch.rms_norm` run unfused, seen
    on an H200) and CLIPViTModel's patch convolution (fp32 there failed a bf16 LLaVA's log-probs on
    bf16 images: "Input type (CUDABFloat16Type) and weight type (torch.cuda.FloatTensor)", H200)."""
    for param in model.parameters():
        if param.is_floating_point() and param.dtype != dtype:
            param.data = param.data.to(dtype)


def build_gpt_model(hf_config: HFModelConfig, cfg: MegatronConfig, *, value_head: bool = False):
    """This pipeline stage's GPTModel (unwrapped, weights uninitialised unless CPU init runs)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    tf_config = to_transformer_config(hf_config, cfg)
    model = GPTModel(
        config=tf_config,
        transformer_layer_spec=block_spec(hf_config, tf_config, machine_kernels()),
        vocab_size=padded_vocab_size(hf_config.vocab_size, cfg),
        max_sequence_length=hf_config.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        parallel_output=True,
        share_embeddings_and_output_weights=hf_config.tie_word_embeddings and not value_head,
        position_embedding_type="rope",
        rotary_base=hf_config.rope_theta,
    )
    if value_head and model.post_process:
        model.output_layer = ValueHead(
            hf_config.hidden_size, hf_config.initializer_range, cfg.seed, tf_config.params_dtype
        )
    parameters_in_dtype(model, tf_config.params_dtype)
    if not cpu_compat.cuda_available():
        return model
    return model.cuda(torch.cuda.current_device())
