"""Image prompts for the `vllm` engine (docs/vlm.md): LLaVA with a CLIP tower, the
vision-language architecture the actor builds. Written against vLLM 0.32.0 and transformers 5.19.

vLLM's own LLaVA (`model_executor/models/llava.py`) imports transformers' Pixtral image processor,
which imports torchvision, and vLLM's CPU build has no torchvision for its torch (docs/vlm.md). Its
Transformers backend (`model_impl="transformers"`, `model_executor/models/transformers/
multimodal.py`) runs transformers' own LLaVA inside vLLM's engine, with vLLM's attention and
linear layers, and needs no torchvision; it also takes the weight names transformers 5 saves, which
the sync streams and vLLM's own LLaVA does not. So a recipe sets `rollout.vllm.model_impl`.

Two rules of vLLM shape each request:
  - the rows carry the `pixel_values` the model's processor made (hybridflow/data/image_prompts.py)
    and vLLM runs that processor again on the images it is given, so each request turns the
    processor's steps off (`mm_processor_kwargs`) and the pixels pass through unchanged. Images go
    as a list of (3, H, W) tensors: a bare 3-D tensor is read as embeddings
    (`multimodal/parse.py`, `is_embeddings`);
  - vLLM expands every image placeholder token of a token prompt into the image's features, even
    one the processor expanded already, so each image's run of placeholders goes in as one token.
"""

import torch

from engines.rollout.base import unpadded_prompts
from engines.rollout.images import image_rows
from hybridflow.protocol import DataProto

# CLIP's image processor with every step off: the pixels are that processor's output already.
PREPROCESSED = {"do_resize": False, "do_center_crop": False, "do_rescale": False, "do_normalize": False,
                "do_convert_rgb": False}  # fmt: skip


def features_per_image(hf_config) -> int:
    """The placeholder tokens the processor writes per image: one per patch, plus CLS with
    LLaVA's `full` feature selection."""
    vision = hf_config.vision_config
    patches = (vision.image_size // vision.patch_size) ** 2
    return patches + int(hf_config.vision_feature_select_strategy == "full")


def collapse_placeholders(ids: list[int], image_token_id: int, per_image: int) -> list[int]:
    """A row's ids with each image's `per_image` placeholder tokens cut to the first."""
    kept, seen = [], 0
    for token in ids:
        if token == image_token_id:
            seen += 1
            if (seen - 1) % per_image:
                continue
        kept.append(token)
    return kept


def vllm_prompts(prompts: DataProto, hf_config) -> list[dict]:
    """vLLM `TokensPrompt`s of the rows, with each row's images when the prompts carry any."""
    rows = unpadded_prompts(prompts)
    pixels = image_rows(prompts, hf_config)
    if pixels is None:
        return [{"prompt_token_ids": ids} for ids in rows]
    per_image = features_per_image(hf_config)
    return [
        _image_prompt(ids, row_pixels, hf_config.image_token_id, per_image, row)
        for row, (ids, row_pixels) in enumerate(zip(rows, pixels, strict=True))
    ]


def _image_prompt(ids: list[int], pixels, image_token_id: int, per_image: int, row: int) -> dict:
    placeholders = ids.count(image_token_id)
    if placeholders != per_image * len(pixels):
        raise ValueError(
            f"prompt row {row} holds {placeholders} image tokens for {len(pixels)} images; the "
            f"model's processor writes {per_image} per image"
        )
    if not len(pixels):
        return {"prompt_token_ids": ids}
    return {
        "prompt_token_ids": collapse_placeholders(ids, image_token_id, per_image),
        "multi_modal_data": {"image": [torch.as_tensor(image) for image in pixels]},  # N of (3, H, W)
        "mm_processor_kwargs": PREPROCESSED,
    }


def check_image_engine_args(engine_args: dict) -> None:
    """ValueError unless a vision-language model goes through vLLM's Transformers backend: vLLM's
    own LLaVA takes other weight names than transformers 5 saves and the sync streams
    (`vision_tower.vision_model.*` for `vision_tower.*`; its loader refused the tiny LLaVA's
    checkpoint, tried 2026-11-29), and it imports torchvision, which vLLM's CPU build lacks."""
    if engine_args.get("model_impl") != "transformers":
        raise ValueError(
            "rollout.name=vllm with a vision-language model: set rollout.vllm.model_impl: transformers "
            "(vLLM's own LLaVA takes other weight names than the sync streams, and needs torchvision: "
            "docs/vlm.md)"
        )
