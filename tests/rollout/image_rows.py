"""Image prompts for the rollout engines' tests: rows of verl's format (a chat prompt with
`<image>` placeholders and PNG bytes), the processor's ids and pixels of each row, the left-padded
`DataProto` an engine takes, and transformers' own greedy continuation of each row alone."""

import io

import numpy as np
import torch

from engines.rollout.config import RolloutConfig, SamplingConfig
from hybridflow.data.image_prompts import decode_images, image_prompt_inputs
from hybridflow.protocol import PIXEL_VALUES_KEY, DataProto

MAX_NEW = 6


def png(shapes: list[tuple[str, tuple[int, int, int]]], size: int = 32) -> bytes:
    """A size x size PNG with one circle or square per entry, side by side."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (size, size), (255, 255, 255))
    draw = ImageDraw.Draw(image)
    for slot, (kind, colour) in enumerate(shapes):
        box = (2 + 10 * slot, 10, 10 + 10 * slot, 18)
        (draw.ellipse if kind == "circle" else draw.rectangle)(box, fill=colour)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


RED_CIRCLE = png([("circle", (220, 30, 30))])
BLUE_SQUARES = png([("square", (30, 30, 220)), ("square", (30, 30, 220))])
MIXED = png([("circle", (30, 160, 30)), ("square", (220, 30, 30)), ("circle", (30, 30, 220))])
ROWS = [
    ("<image>How many circles are there?", [RED_CIRCLE]),
    ("What is 2+3?", []),
    ("<image>Count them.", [MIXED]),
    ("<image><image>Are they the same?", [BLUE_SQUARES, RED_CIRCLE]),
]


def row_inputs(processor, rows=ROWS) -> list[tuple[list[int], np.ndarray]]:
    return [
        image_prompt_inputs(
            processor, [{"role": "user", "content": text}], decode_images(images, f"row {i}"), f"row {i}"
        )
        for i, (text, images) in enumerate(rows)
    ]


def left_padded(inputs, pad_token_id: int, **meta_info) -> DataProto:
    width = max(len(ids) for ids, _ in inputs)
    ids = torch.full((len(inputs), width), pad_token_id, dtype=torch.long)  # (B, P)
    mask = torch.zeros_like(ids)
    for row, (row_ids, _) in enumerate(inputs):
        ids[row, width - len(row_ids) :] = torch.tensor(row_ids)
        mask[row, width - len(row_ids) :] = 1
    pixels = np.empty(len(inputs), dtype=object)
    pixels[:] = [row_pixels for _, row_pixels in inputs]
    return DataProto.from_dict(
        tensors={
            "input_ids": ids,
            "attention_mask": mask,
            "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
        },
        non_tensors={PIXEL_VALUES_KEY: pixels},
        meta_info=meta_info,
    )


def reference_greedy(model, inputs, eos_ids: list[int], pad_id: int) -> list[list[int]]:
    """transformers' greedy continuation of each row alone (no padding), cut after the first EOS."""
    responses = []
    for ids, pixels in inputs:
        extra = {PIXEL_VALUES_KEY: torch.as_tensor(pixels)} if len(pixels) else {}
        with torch.no_grad():
            out = model.generate(
                input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                do_sample=False, max_new_tokens=MAX_NEW, eos_token_id=eos_ids, pad_token_id=pad_id, **extra,
            )  # fmt: skip
        tokens = out[0, len(ids) :].tolist()
        ends = [i for i, token in enumerate(tokens) if token in eos_ids]
        responses.append(tokens[: ends[0] + 1] if ends else tokens)
    return responses


def engine_responses(out: DataProto) -> list[list[int]]:
    rows = zip(out.batch["responses"], out.batch["response_mask"], strict=True)
    return [row[mask.bool()].tolist() for row, mask in rows]


def greedy_rollout_config(engine: str, load_format: str = "auto") -> RolloutConfig:
    """Greedy decoding of MAX_NEW tokens with log-probs; the vllm engine through vLLM's Transformers
    backend (vLLM's own LLaVA needs torchvision: engines/rollout/vllm_images.py)."""
    greedy = SamplingConfig(do_sample=False, temperature=0.0, max_new_tokens=MAX_NEW)
    vllm = {"model_impl": "transformers", "max_model_len": 256} if engine == "vllm" else {}
    return RolloutConfig(
        name=engine, response_length=MAX_NEW, load_format=load_format, sampling=greedy, val_sampling=greedy,
        calculate_log_probs=True, vllm=vllm,
    )  # fmt: skip
