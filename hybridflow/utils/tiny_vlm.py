"""Builds a tiny, randomly initialised LLaVA-shaped vision-language model, made locally (nothing is
downloaded): a CLIP vision tower, LLaVA's two-layer MLP projector and the project's tiny Qwen2 (or
Llama) language model with its one-token-per-character tokenizer plus an `<image>` token.

The result is an ordinary Hugging Face directory for `LlavaForConditionalGeneration` (config.json,
safetensors, tokenizer files, and a `LlavaProcessor` whose image processor is the slow PIL
`CLIPImageProcessorPil`, so no torchvision is needed). The processor expands each `<image>` in a
prompt into one `<image>` token per image feature, as llava-1.5's does.
"""

from dataclasses import dataclass
from pathlib import Path

from hybridflow.utils.tiny_model import TinyModelConfig, build_hf_config, build_tokenizer, redraw_weights

IMAGE_TOKEN = "<image>"
TEXT_ARCHS = ("qwen2", "llama")
FEATURE_STRATEGIES = ("default", "full")  # default: drop the CLS feature (llava-1.5); full: keep it


@dataclass
class TinyVLMConfig:
    """Shapes of the tiny VLM. Defaults: a 32x32 image in 8x8 patches (16 patches + CLS), a
    3-layer CLIP tower of width 32 whose second-to-last layer feeds the projector (llava-1.5's
    choice), and a 2-layer Qwen2 of width 64. Heads and widths divide by TP 2."""

    text_arch: str = "qwen2"  # one of TEXT_ARCHS
    text_layers: int = 2
    text_hidden_size: int = 64
    text_heads: int = 4
    text_kv_heads: int = 2
    text_intermediate_size: int = 128
    image_size: int = 32
    patch_size: int = 8
    vision_hidden_size: int = 32
    vision_layers: int = 3
    vision_heads: int = 4
    vision_intermediate_size: int = 64
    vision_feature_layer: int = -2  # index into the tower's hidden states (0: the embeddings)
    vision_feature_select_strategy: str = "default"  # one of FEATURE_STRATEGIES
    tie_word_embeddings: bool = False
    seed: int = 0
    init_std: float = 0.2  # > 0: every weight redrawn (tiny_model.redraw_weights); 0: transformers' init

    def validate(self) -> None:
        if self.text_arch not in TEXT_ARCHS:
            raise ValueError(f"text_arch must be one of {TEXT_ARCHS}, got {self.text_arch!r}")
        if self.vision_feature_select_strategy not in FEATURE_STRATEGIES:
            raise ValueError(
                f"vision_feature_select_strategy must be one of {FEATURE_STRATEGIES}, "
                f"got {self.vision_feature_select_strategy!r}"
            )
        if self.image_size % self.patch_size:
            raise ValueError(f"patch_size={self.patch_size} must divide image_size={self.image_size}")
        if not -self.vision_layers <= self.vision_feature_layer <= self.vision_layers:
            raise ValueError(
                f"vision_feature_layer={self.vision_feature_layer} must index one of the "
                f"{self.vision_layers + 1} hidden states of the vision tower"
            )

    def image_feature_count(self) -> int:
        """How many `<image>` tokens one image becomes: one per patch, plus CLS with "full"."""
        patches = (self.image_size // self.patch_size) ** 2
        return patches + (self.vision_feature_select_strategy == "full")


def build_vlm_tokenizer():
    """The tiny model's tokenizer with `<image>` added as a special (never split) token."""
    tokenizer = build_tokenizer()
    tokenizer.add_tokens([IMAGE_TOKEN], special_tokens=True)
    return tokenizer


def _text_hf_config(cfg: TinyVLMConfig, tokenizer):
    """The tiny text model's transformers config (tiny_model.py), its vocabulary holding `<image>`."""
    text_cfg = TinyModelConfig(
        arch=cfg.text_arch,
        num_layers=cfg.text_layers,
        hidden_size=cfg.text_hidden_size,
        num_heads=cfg.text_heads,
        num_kv_heads=cfg.text_kv_heads,
        intermediate_size=cfg.text_intermediate_size,
        tie_word_embeddings=cfg.tie_word_embeddings,
    )
    text_cfg.validate()
    return build_hf_config(text_cfg, tokenizer)


def _clip_config(cfg: TinyVLMConfig):
    from transformers import CLIPVisionConfig

    return CLIPVisionConfig(
        hidden_size=cfg.vision_hidden_size,
        intermediate_size=cfg.vision_intermediate_size,
        num_hidden_layers=cfg.vision_layers,
        num_attention_heads=cfg.vision_heads,
        image_size=cfg.image_size,
        patch_size=cfg.patch_size,
        projection_dim=cfg.vision_hidden_size,  # CLIP's contrastive head, which LLaVA does not build
    )


def build_llava_config(cfg: TinyVLMConfig, tokenizer):
    """LlavaConfig of the CLIP tower, the tiny text model and the feature choices of `cfg`."""
    from transformers import LlavaConfig

    return LlavaConfig(
        vision_config=_clip_config(cfg),
        text_config=_text_hf_config(cfg, tokenizer),
        image_token_index=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
        image_seq_length=cfg.image_feature_count(),
        vision_feature_layer=cfg.vision_feature_layer,
        vision_feature_select_strategy=cfg.vision_feature_select_strategy,
        tie_word_embeddings=cfg.tie_word_embeddings,
    )


def build_processor(cfg: TinyVLMConfig, tokenizer):
    """LlavaProcessor: resize/crop to image_size with the PIL CLIP image processor, `<image>` expanded."""
    from transformers import LlavaProcessor
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    image_processor = CLIPImageProcessorPil(
        size={"shortest_edge": cfg.image_size}, crop_size={"height": cfg.image_size, "width": cfg.image_size}
    )
    return LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=cfg.patch_size,
        vision_feature_select_strategy=cfg.vision_feature_select_strategy,
        num_additional_image_tokens=1,  # CLIP's CLS feature, which "default" then drops
        chat_template=tokenizer.chat_template,
    )


def make_tiny_vlm(out_dir: str | Path, **overrides) -> Path:
    """Writes the tiny LLaVA model, tokenizer and processor (fp32) to `out_dir` and returns it.

    `overrides` are `TinyVLMConfig` fields; the same arguments always give the same weights."""
    import torch
    from transformers import LlavaForConditionalGeneration

    unknown = set(overrides) - set(TinyVLMConfig.__dataclass_fields__)
    if unknown:
        raise TypeError(f"make_tiny_vlm got unknown settings {sorted(unknown)}")
    cfg = TinyVLMConfig(**overrides)
    cfg.validate()
    tokenizer = build_vlm_tokenizer()
    torch.manual_seed(cfg.seed)
    model = LlavaForConditionalGeneration(build_llava_config(cfg, tokenizer)).float()
    if cfg.init_std:
        redraw_weights(model, cfg.init_std)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    build_processor(cfg, tokenizer).save_pretrained(out)
    return out
