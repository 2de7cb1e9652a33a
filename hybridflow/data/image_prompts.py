"""Image prompts: the row format verl's users have, turned into model inputs by the
model's own Hugging Face processor.

A row holds a chat `prompt` whose text marks each image with the model's placeholder (`<image>`
for LLaVA) and an `images` column: a list of encoded images (PNG/JPEG bytes, or the
`{"bytes": ..., "path": ...}` dicts that `datasets.Image` writes to parquet), one per placeholder, in
order. The processor expands each placeholder into the image's feature tokens and makes its
`pixel_values`; in a `DataProto` those ride in `non_tensor_batch["pixel_values"]`, one
(n_images, 3, H, W) float32 array per row, beside the expanded `input_ids`.
"""

import io

import numpy as np

from hybridflow.protocol import PIXEL_VALUES_KEY

IMAGES_KEY = "images"


def decode_images(values, where: str) -> list:
    """RGB PIL images from a row's `images` value; ValueError naming `where` for anything else."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(values, (bytes, dict)) or not hasattr(values, "__iter__"):
        kind = type(values).__name__
        raise ValueError(f"{where}: `{IMAGES_KEY}` must be a list of encoded images, got {kind}")
    images = []
    for index, value in enumerate(values):
        data = value.get("bytes") if isinstance(value, dict) else value
        if not isinstance(data, bytes):
            raise ValueError(
                f"{where}: `{IMAGES_KEY}[{index}]` must be image bytes or a {{'bytes': ...}} dict, "
                f"got {type(value).__name__}"
            )
        try:
            images.append(Image.open(io.BytesIO(data)).convert("RGB"))
        except UnidentifiedImageError as err:
            raise ValueError(f"{where}: `{IMAGES_KEY}[{index}]` is not an image PIL reads ({err})") from err
    return images


def image_prompt_inputs(
    processor, messages: list[dict], images: list, where: str, tools: list[dict] | None = None
) -> tuple[list[int], np.ndarray]:
    """(token ids with each placeholder expanded, pixel values (n_images, 3, H, W) float32) of a chat
    prompt rendered by the processor's chat template (with the `tools`' schemas, when given)."""
    text = processor.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    placeholders = text.count(processor.image_token)
    if placeholders != len(images):
        raise ValueError(
            f"{where}: the prompt marks {placeholders} image(s) with {processor.image_token!r} but "
            f"`{IMAGES_KEY}` holds {len(images)}; give one image per placeholder"
        )
    # The template already wrote any BOS/role tokens; adding special tokens again would double them.
    out = processor(text=text, images=images or None, return_tensors="pt", add_special_tokens=False)
    pixels = out[PIXEL_VALUES_KEY].float().numpy() if images else np.zeros((0, 3, 1, 1), np.float32)
    return out["input_ids"][0].tolist(), pixels
