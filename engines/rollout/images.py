"""What the rollout engines share about image prompts (docs/vlm.md): which models take
images, and the refusal of image placeholders that arrive without their pixels."""

import torch

from hybridflow.protocol import PIXEL_VALUES_KEY, DataProto


def is_vision_language(hf_config) -> bool:
    return getattr(hf_config, "vision_config", None) is not None


def _refuse_image_tokens_without_pixels(hf_config, input_ids: torch.Tensor) -> None:
    """A vision-language model given image placeholder tokens but no `pixel_values` would read the
    placeholders as text and generate from a prompt the policy never sees: refused."""
    if not is_vision_language(hf_config):
        return
    image_token = getattr(hf_config, "image_token_id", None)
    count = int((input_ids == image_token).sum()) if image_token is not None else 0
    if count:
        raise ValueError(
            f"the prompts hold {count} image tokens (id {image_token}) but no `{PIXEL_VALUES_KEY}`: "
            "pass each row's pixels with its prompt (hybridflow/data/image_prompts.py)"
        )


def image_rows(prompts: DataProto, hf_config):
    """The rows' `pixel_values` (an object array, one (N_i, 3, H, W) array per row) or None when
    the prompts carry none; pixels for a text model, or image tokens without pixels, are refused."""
    rows = prompts.non_tensor_batch.get(PIXEL_VALUES_KEY)
    if rows is None:
        _refuse_image_tokens_without_pixels(hf_config, prompts.batch["input_ids"])
        return None
    if not is_vision_language(hf_config):
        raise ValueError(
            f"the prompts carry `{PIXEL_VALUES_KEY}` but the rollout model "
            f"({hf_config.model_type}) takes no images"
        )
    return rows
