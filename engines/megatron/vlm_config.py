"""A Hugging Face LLaVA config.json as the Megatron model reads it (vlm.py builds the model): the
CLIP tower's and the text model's fields, and refusals naming what is not built. Apart from vlm.py
so that the recipe checks read it without importing Megatron-Core.
"""

import json
from dataclasses import dataclass
from pathlib import Path

from engines.megatron.model import HFModelConfig, check_unsupported_features, dense_text_fields

TEXT_ARCHITECTURES = {"qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM"}


@dataclass(frozen=True)
class VisionConfig:
    """The CLIP vision tower's fields that the Megatron model needs."""

    hidden_size: int
    intermediate_size: int
    num_layers: int  # in the Hugging Face tower; Megatron builds `VLMConfig.vision_layers_used`
    num_heads: int
    image_size: int
    patch_size: int
    layer_norm_eps: float

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def num_positions(self) -> int:
        return (self.image_size // self.patch_size) ** 2 + 1  # patches + CLS


@dataclass(frozen=True)
class VLMConfig:
    """A Hugging Face LLaVA config.json, as the Megatron model reads it."""

    text: HFModelConfig
    vision: VisionConfig
    image_token_id: int
    vision_feature_layer: int
    drop_class_token: bool  # vision_feature_select_strategy "default"
    tie_word_embeddings: bool
    raw: dict

    @property
    def vision_layers_used(self) -> int:
        """Tower layers before the selected hidden state (hidden state 0 is the embeddings)."""
        layer = self.vision_feature_layer
        return layer if layer >= 0 else self.vision.num_layers + 1 + layer

    @property
    def image_feature_count(self) -> int:
        return self.vision.num_positions - self.drop_class_token


def _text_config(text: dict, source_dir: str, where: str) -> HFModelConfig:
    family = text.get("model_type")
    if family not in TEXT_ARCHITECTURES:
        raise ValueError(
            f"{where}: text model_type {family!r} is not supported; supported: {sorted(TEXT_ARCHITECTURES)}"
        )
    check_unsupported_features(text, family, where)
    return HFModelConfig(
        architecture=TEXT_ARCHITECTURES[family],
        model_type=family,
        **dense_text_fields(text, family, where),
        source_dir=source_dir,
        raw=text,
    )


def _vision_config(vision: dict, where: str) -> VisionConfig:
    if vision.get("model_type") != "clip_vision_model" or vision.get("hidden_act") != "quick_gelu":
        raise ValueError(
            f"{where}: only a CLIP vision tower with quick_gelu is supported, got model_type "
            f"{vision.get('model_type')!r}, hidden_act {vision.get('hidden_act')!r}"
        )
    return VisionConfig(
        hidden_size=vision["hidden_size"],
        intermediate_size=vision["intermediate_size"],
        num_layers=vision["num_hidden_layers"],
        num_heads=vision["num_attention_heads"],
        image_size=vision["image_size"],
        patch_size=vision["patch_size"],
        layer_norm_eps=vision.get("layer_norm_eps", 1e-5),
    )


def _check_feature_layer(raw: dict, where: str) -> None:
    """The selected hidden state must be a layer's output (Megatron builds layers 1..it)."""
    layer, layers = raw.get("vision_feature_layer", -2), raw["vision_config"]["num_hidden_layers"]
    if not 1 <= (layer if layer >= 0 else layers + 1 + layer) <= layers:
        raise ValueError(
            f"{where}: vision_feature_layer={layer} selects no layer output of the {layers}-layer tower"
        )


def _check_llava_options(raw: dict, where: str) -> None:
    if raw.get("architectures") != ["LlavaForConditionalGeneration"]:
        raise ValueError(f"{where}: expected LlavaForConditionalGeneration, got {raw.get('architectures')}")
    if not isinstance(raw.get("vision_feature_layer", -2), int):
        raise ValueError(f"{where}: a list of vision_feature_layer values is not supported")
    _check_feature_layer(raw, where)
    if raw.get("vision_feature_select_strategy", "default") not in ("default", "full"):
        raise ValueError(f"{where}: vision_feature_select_strategy must be 'default' or 'full'")
    if raw.get("projector_hidden_act", "gelu") != "gelu" or not raw.get("multimodal_projector_bias", True):
        raise ValueError(f"{where}: only a GELU projector with biases is supported")


def load_vlm_config(path) -> VLMConfig:
    """Read `<path>/config.json` of a LLaVA checkpoint; ValueError naming what is not supported."""
    config_file = Path(path) / "config.json"
    raw = json.loads(config_file.read_text())
    where = str(config_file)
    _check_llava_options(raw, where)
    tie = bool(raw.get("tie_word_embeddings", False))
    text = {**raw["text_config"], "tie_word_embeddings": tie}  # LLaVA keeps the flag at the top level
    return VLMConfig(
        text=_text_config(text, str(Path(path).resolve()), where),
        vision=_vision_config(raw["vision_config"], where),
        image_token_id=raw["image_token_index"],
        vision_feature_layer=raw.get("vision_feature_layer", -2),
        drop_class_token=raw.get("vision_feature_select_strategy", "default") == "default",
        tie_word_embeddings=tie,
        raw=raw,
    )
