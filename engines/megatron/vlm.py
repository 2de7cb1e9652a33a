"""Hugging Face LLaVA config -> Megatron-Core's own `LLaVAModel` (megatron/core/models/multimodal/
llava_model.py): a `CLIPViTModel` vision tower, a `MultimodalProjector` two-layer MLP and the
project's GPT language model (model.py's Qwen2 / Llama config, layer spec and SDPA attention).

Supported: `LlavaForConditionalGeneration` with a CLIP vision tower (quick_gelu), one integer
`vision_feature_layer`, feature strategy "default" (CLS feature dropped) or "full", a GELU
projector with biases, and a dense Qwen2 or Llama language model. Megatron builds only the vision
layers up to `vision_feature_layer`: the later layers and the tower's post_layernorm never reach
LLaVA's output, so they stay in the Hugging Face checkpoint (vlm_weights.py copies them on export).

Megatron-Core's local layer specs only: Megatron's local ViT spec (vit_layer_specs.py) marks its
attention causal, which CLIP is not, and allocates its attention on CUDA, so the vision layer spec
is built here with a bidirectional SDPA core attention. The Transformer Engine path (TE ViT spec,
fused-norm weight names) is not built yet.

Input convention (Megatron's): one IMAGE_SLOT id per image in `input_ids`; `LLaVAModel` expands it
to the image's features. A processor's expanded ids become that with `mark_image_slots` (the
prompts' placeholders only) and `collapse_image_tokens`.
"""

from contextlib import contextmanager
from dataclasses import replace

import torch
import torch.nn.functional as F

from engines.megatron import cpu_compat
from engines.megatron.attention import SDPACoreAttention
from engines.megatron.config import MegatronConfig
from engines.megatron.model import (
    ModelKernels,
    block_spec,
    fusion_settings,
    padded_vocab_size,
    parameters_in_dtype,
    params_dtype,
    to_transformer_config,
)
from engines.megatron.vlm_config import VLMConfig

# The local (no Transformer Engine) kernels: see the module docstring.
LOCAL_KERNELS = ModelKernels(transformer_engine=False, fused_wgrad=False)


# ---------------------------------------------------------------- Megatron configs and specs


def _common_settings(cfg: MegatronConfig) -> dict:
    """TransformerConfig settings the vision tower and projector share: TP size, dtype, biased
    non-gated MLPs, no dropout, and no fused kernels (they run Megatron-Core's local modules)."""
    dtype = params_dtype(cfg)
    return dict(
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=cfg.tensor_model_parallel_size,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        add_bias_linear=True,
        gated_linear_unit=False,
        **fusion_settings(LOCAL_KERNELS),
        **cpu_compat.transformer_config_overrides(),
    )


def vision_transformer_config(vlm: VLMConfig, cfg: MegatronConfig):
    """CLIP encoder layers: pre-LayerNorm, biased linears, quick_gelu, one KV head per head."""
    from megatron.core.activations import quick_gelu
    from megatron.core.transformer import TransformerConfig

    v = vlm.vision
    config = TransformerConfig(
        num_layers=vlm.vision_layers_used,
        hidden_size=v.hidden_size,
        ffn_hidden_size=v.intermediate_size,
        num_attention_heads=v.num_heads,
        kv_channels=v.head_dim,
        normalization="LayerNorm",
        layernorm_epsilon=v.layer_norm_eps,
        add_qkv_bias=True,
        activation_func=quick_gelu,
        **_common_settings(cfg),
    )
    config.vision_model_type = "clip"  # LLaVAModel reads this attribute (Megatron's own convention)
    return config


def projection_transformer_config(vlm: VLMConfig, cfg: MegatronConfig):
    """LLaVA's projector: vision hidden -> text hidden (GELU) -> text hidden, with biases."""
    from megatron.core.transformer import TransformerConfig

    t = vlm.text
    return TransformerConfig(
        num_layers=1,
        hidden_size=t.hidden_size,
        ffn_hidden_size=t.hidden_size,
        num_attention_heads=t.num_attention_heads,
        activation_func=F.gelu,  # exact erf GELU, as HF's "gelu"
        **_common_settings(cfg),
    )


class BidirectionalSDPACoreAttention(SDPACoreAttention):
    """SDPA core attention without a causal mask: every image patch attends to every other."""

    def forward(
        self,
        query,
        key,
        value,
        attention_mask,
        attn_mask_type=None,
        attention_bias=None,
        packed_seq_params=None,
    ):
        if attention_mask is not None or attention_bias is not None or packed_seq_params is not None:
            raise ValueError("the vision tower's attention takes no mask, bias or packed sequences")
        seq, batch, heads, head_dim = query.shape
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [s, b, n, d] -> [b, n, s, d]
        dropout_p = self.dropout_p if self.training else 0.0
        out = F.scaled_dot_product_attention(
            q, k, v, dropout_p=dropout_p, scale=self.softmax_scale
        )  # (b, n, s, d)
        return out.permute(2, 0, 1, 3).reshape(seq, batch, heads * head_dim)


def _vision_attention_spec():
    """Self-attention with no mask (CLIP is bidirectional), biased QKV and output projections."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.spec_utils import ModuleSpec

    submodules = SelfAttentionSubmodules(
        linear_qkv=ColumnParallelLinear,
        core_attention=BidirectionalSDPACoreAttention,
        linear_proj=RowParallelLinear,
    )
    return ModuleSpec(
        module=SelfAttention, params={"attn_mask_type": AttnMaskType.no_mask}, submodules=submodules
    )


def vision_layer_spec():
    """A CLIP encoder layer from Megatron-Core's local modules (see the module docstring)."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

    submodules = TransformerLayerSubmodules(
        input_layernorm=WrappedTorchNorm,
        self_attention=_vision_attention_spec(),
        self_attn_bda=get_bias_dropout_add,
        pre_mlp_layernorm=WrappedTorchNorm,
        mlp=projector_spec(),
        mlp_bda=get_bias_dropout_add,
    )
    return ModuleSpec(module=TransformerLayer, submodules=submodules)


def projector_spec():
    """Column-parallel then row-parallel linear: the MLP of a CLIP layer and of LLaVA's projector."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec

    return ModuleSpec(
        module=MLP, submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
    )


@contextmanager
def _clip_norms_without_te():
    """Megatron-Core 0.16.1's CLIPViTModel defaults its ln_pre to torch.nn.LayerNorm when Transformer
    Engine is absent and builds it with `config=` (build_module), which LayerNorm refuses; LLaVAModel
    passes no norm of its own. For the construction only, LLaVAModel's CLIPViTModel gets Megatron's
    WrappedTorchNorm (a LayerNorm built from the config)."""
    from functools import partial

    from megatron.core.models.multimodal import llava_model
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    original = llava_model.CLIPViTModel
    llava_model.CLIPViTModel = partial(original, ln_pre_impl=WrappedTorchNorm, ln_post_impl=WrappedTorchNorm)
    try:
        yield
    finally:
        llava_model.CLIPViTModel = original


def _language_config(vlm: VLMConfig, cfg: MegatronConfig):
    """model.py's TransformerConfig of the text model, its fused kernels off to match the local spec."""
    return replace(to_transformer_config(vlm.text, cfg), **fusion_settings(LOCAL_KERNELS))


def build_llava_model(vlm: VLMConfig, cfg: MegatronConfig):
    """Megatron-Core's LLaVAModel for this config (no pipeline parallelism; weights not loaded)."""
    from megatron.core.enums import ModelType
    from megatron.core.models.multimodal.llava_model import LLaVAModel

    if cfg.pipeline_model_parallel_size != 1 or cfg.context_parallel_size != 1 or cfg.sequence_parallel:
        raise ValueError("the LLaVA model supports tensor parallelism only (PP, CP and SP are 1 / off)")
    language_config = _language_config(vlm, cfg)
    with cpu_compat.cuda_calls_on_cpu(), _clip_norms_without_te():  # CLIPViTModel calls .cuda()
        model = LLaVAModel(
            language_transformer_config=language_config,
            language_transformer_layer_spec=block_spec(vlm.text, language_config, LOCAL_KERNELS),
            language_vocab_size=padded_vocab_size(vlm.text.vocab_size, cfg),
            language_max_sequence_length=vlm.text.max_position_embeddings,
            vision_transformer_config=vision_transformer_config(vlm, cfg),
            vision_transformer_layer_spec=vision_layer_spec(),
            drop_vision_class_token=vlm.drop_class_token,
            vision_projection_config=projection_transformer_config(vlm, cfg),
            vision_projection_layer_spec=projector_spec().submodules,
            parallel_output=True,
            share_embeddings_and_output_weights=vlm.tie_word_embeddings,
            language_position_embedding_type="rope",
            language_rotary_base=vlm.text.rope_theta,
            img_h=vlm.vision.image_size,
            img_w=vlm.vision.image_size,
            patch_dim=vlm.vision.patch_size,
            image_token_index=IMAGE_SLOT,
        )
    # What Megatron's schedules read and Megatron-LM's get_model sets on each chunk (LLaVAModel
    # does not); `hf_config`, the text config, is what the actor reads of build.py's GPT models,
    # `vlm_config` what forward.py and the weight stream read of a LLaVA one.
    model.model_type = ModelType.encoder_or_decoder
    model.hf_config, model.vlm_config = vlm.text, vlm
    parameters_in_dtype(model, language_config.params_dtype)
    if not cpu_compat.cuda_available():
        return model
    return model.cuda(torch.cuda.current_device())  # CLIPViTModel's conv and embeddings start on the host


# The id LLaVAModel is built to fill with image features, outside every vocabulary (Megatron's own
# convention): a prompt's image placeholders become it, while the placeholder id sampled in a
# response stays a token, embedded as text, as transformers' generate embeds it.
IMAGE_SLOT = -200


def mark_image_slots(input_ids: torch.Tensor, image_token_id: int, prompt_length: int) -> torch.Tensor:
    """input_ids (B, T) with the image placeholders of the first `prompt_length` positions (the
    prompts) replaced by IMAGE_SLOT; a copy."""
    marked = input_ids.clone()
    prompts = marked[:, :prompt_length]  # a view: writes land in `marked`
    prompts[prompts == image_token_id] = IMAGE_SLOT
    return marked  # (B, T)


def collapse_image_tokens(
    input_ids: torch.Tensor, image_token_id: int, features_per_image: int, pad_token_id: int = 0
) -> torch.Tensor:
    """A processor's ids (one image token per image feature) -> Megatron's (one per image).

    input_ids (B, T), each image `features_per_image` consecutive image tokens. Returns (B, T'):
    the first token of each image kept, rows with fewer images right-padded with `pad_token_id` to
    the longest collapsed row (`LLaVAModel` pads them again after expanding, so every row's first T
    combined positions are its original positions)."""
    is_image = input_ids == image_token_id  # (B, T)
    counts = is_image.sum(-1)  # (B,)
    if (counts % features_per_image).any():
        raise ValueError(
            f"image tokens per row {counts.tolist()}: each image must be {features_per_image} tokens"
        )
    order = is_image.cumsum(-1) - 1  # (B, T): index of each image token among its row's
    keep = ~is_image | (order % features_per_image == 0)  # (B, T)
    lengths = keep.sum(-1)  # (B,)
    collapsed = input_ids.new_full((input_ids.shape[0], int(lengths.max())), pad_token_id)  # (B, T')
    collapsed[torch.arange(collapsed.shape[1], device=input_ids.device) < lengths[:, None]] = input_ids[keep]
    return collapsed


def llava_attention_mask(
    attention_mask: torch.Tensor, input_ids: torch.Tensor, image_token_id: int, features_per_image: int
) -> torch.Tensor:
    """The (B, T) padding mask extended with zeros to the length `LLaVAModel` makes of the
    collapsed rows, T + (F - 1) * (most - fewest images in a row): the rows with fewer images end
    in that many padded positions, which no real token sees under the causal mask."""
    images = (input_ids == image_token_id).sum(-1) // features_per_image  # (B,)
    extra = int(images.max() - images.min()) * (features_per_image - 1)
    return F.pad(attention_mask, (0, extra))  # (B, T + extra)


def micro_batch_images(pixel_rows, size: int) -> list[torch.Tensor]:
    """Per micro-batch of `size` consecutive rows, its rows' images in row order (the order of the
    image tokens, which `LLaVAModel` fills in turn): (N, 3, H, W), N = 0 where no row has one.
    `pixel_rows` holds one (n_images, 3, H, W) array per row (protocol.PIXEL_VALUES_KEY)."""
    groups = [pixel_rows[i : i + size] for i in range(0, len(pixel_rows), size)]
    return [_stacked_images(group) for group in groups]


def _stacked_images(rows) -> torch.Tensor:
    images = [torch.as_tensor(row) for row in rows if len(row)]
    return torch.cat(images) if images else torch.zeros(0, 3, 1, 1)  # (N, 3, H, W)
