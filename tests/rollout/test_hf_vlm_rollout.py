"""The `hf` rollout engine on image prompts, with the tiny random LLaVA model
(`hybridflow.utils.tiny_vlm`): verl's row format (a chat prompt with `<image>` placeholders and an
`images` column of PNG bytes) through the model's own processor into a left-padded `DataProto`.

The reference is transformers itself, row by row without padding: `generate` on the processor's
output for that row alone, from the checkpoint loaded with `from_pretrained`.
"""

import numpy as np
import pytest
import torch
from image_rows import (
    MAX_NEW,
    MIXED,
    RED_CIRCLE,
    ROWS,
    engine_responses,
    greedy_rollout_config,
    left_padded,
    reference_greedy,
    row_inputs,
)

from engines.rollout.hf_rollout import HFRolloutEngine
from hybridflow.data.image_prompts import decode_images, image_prompt_inputs
from hybridflow.protocol import PIXEL_VALUES_KEY, DataProto
from hybridflow.utils.tiny_vlm import make_tiny_vlm


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    return make_tiny_vlm(tmp_path_factory.mktemp("tiny_vlm"))


@pytest.fixture(scope="module")
def processor(vlm):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(vlm)


@pytest.fixture(scope="module")
def reference_model(vlm):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(vlm, dtype=torch.float32).eval()


def make_engine(vlm, load_format: str = "auto") -> HFRolloutEngine:
    return HFRolloutEngine(vlm, greedy_rollout_config("hf", load_format), device="cpu")


def test_processor_expands_each_placeholder_into_the_images_features(processor):
    inputs = row_inputs(processor)
    image_token = processor.tokenizer.convert_tokens_to_ids(processor.image_token)
    for (_, images), (ids, pixels) in zip(ROWS, inputs, strict=True):
        assert ids.count(image_token) == 16 * len(images)  # 32x32 images in 8x8 patches, CLS dropped
        assert pixels.shape[0] == len(images) and pixels.dtype == np.float32


def test_greedy_from_image_prompts_matches_transformers_row_by_row(vlm, processor, reference_model):
    engine = make_engine(vlm)
    inputs = row_inputs(processor)
    out = engine.generate_sequences(left_padded(inputs, engine.pad_token_id))
    assert engine_responses(out) == reference_greedy(
        reference_model, inputs, engine.eos_token_ids, engine.pad_token_id
    )
    assert out.batch["rollout_log_probs"].shape == (len(ROWS), MAX_NEW)


def test_the_images_reach_the_model(vlm, processor):
    """The same text with the first two rows' images swapped gives other log-probs for those rows."""
    engine = make_engine(vlm)
    rows = [("<image>What is this?", [RED_CIRCLE]), ("<image>What is this?", [MIXED])]
    swapped = [(text, images) for (text, _), (_, images) in zip(rows, rows[::-1], strict=True)]
    first, second = (
        engine.generate_sequences(left_padded(row_inputs(processor, r), engine.pad_token_id))
        for r in (rows, swapped)
    )
    first_token = first.batch["rollout_log_probs"][:, 0]  # (2,): the same prompt tokens, other pixels
    assert (first_token - second.batch["rollout_log_probs"][:, 0].flip(0)).abs().max() < 1e-5
    assert (first_token[0] - first_token[1]).abs() > 1e-4


def test_weights_synced_by_checkpoint_name_reproduce_the_checkpoint(vlm, processor):
    """An engine started from random weights and loaded with the checkpoint's own tensors, under
    the names the checkpoint has (vision tower and projector included), generates as one loaded
    from the directory."""
    from safetensors.torch import load_file

    loaded, dummy = make_engine(vlm), make_engine(vlm, load_format="dummy")
    tensors = load_file(vlm / "model.safetensors")
    assert set(dummy.weight_checksums()) == set(tensors)
    assert any(name.startswith("vision_tower.") for name in tensors)
    assert any(name.startswith("multi_modal_projector.") for name in tensors)
    dummy.update_weights(tensors.items())
    assert dummy.weight_checksums() == loaded.weight_checksums()
    prompts = left_padded(row_inputs(processor), loaded.pad_token_id)
    assert engine_responses(dummy.generate_sequences(prompts)) == engine_responses(
        loaded.generate_sequences(prompts)
    )


def test_pixel_values_for_a_text_model_are_refused(tmp_path):
    from hybridflow.utils.tiny_model import make_tiny_model

    engine = make_engine(make_tiny_model(tmp_path / "text"))
    prompts = left_padded([([5, 6, 7], np.zeros((1, 3, 32, 32), np.float32))], engine.pad_token_id)
    with pytest.raises(
        ValueError, match=r"carry `pixel_values` but the rollout model \(qwen2\) takes no images"
    ):
        engine.generate_sequences(prompts)


def test_image_tokens_without_their_pixels_are_refused(vlm, processor):
    """What the driver once sent: the prompt tensors without the pixels, which the engine would
    read as text placeholders and generate from prompts the actor never scores."""
    engine = make_engine(vlm)
    prompts = left_padded(row_inputs(processor), engine.pad_token_id)
    prompts.non_tensor_batch.pop(PIXEL_VALUES_KEY)
    with pytest.raises(ValueError, match=r"hold 64 image tokens \(id \d+\) but no `pixel_values`"):
        engine.generate_sequences(prompts)


@pytest.mark.parametrize(
    ("images", "message"),
    [
        (b"\x89PNG", "`images` must be a list of encoded images, got bytes"),
        (["not bytes"], r"`images\[0\]` must be image bytes"),
        ([b"not an image"], r"`images\[0\]` is not an image PIL reads"),
    ],
)
def test_bad_images_column_names_the_row(images, message):
    with pytest.raises(ValueError, match=f"row 7: {message}"):
        decode_images(images, "row 7")


def test_placeholder_count_must_match_the_images(processor):
    with pytest.raises(ValueError, match=r"marks 2 image\(s\) with '<image>' but `images` holds 1"):
        image_prompt_inputs(
            processor,
            [{"role": "user", "content": "<image><image>?"}],
            decode_images([RED_CIRCLE], "r"),
            "row 3",
        )


def write_image_rows(path, rows=ROWS):
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.Table.from_pylist([
        {"prompt": [{"role": "user", "content": text}], "images": images, "data_source": "shapes",
         "reward_model": {"ground_truth": str(i)}}
        for i, (text, images) in enumerate(rows)
    ])  # fmt: skip
    pq.write_table(table, path)
    return str(path)


def test_prompt_dataset_carries_the_images_to_the_engine(vlm, processor, tmp_path):
    """parquet rows -> PromptDataset (with the processor) -> collate -> DataProto -> the engine:
    the same responses as the rows processed by hand."""
    from hybridflow.data.prompt_dataset import PromptDataset, collate_prompts

    engine = make_engine(vlm)
    dataset = PromptDataset(
        [write_image_rows(tmp_path / "images.parquet")], processor.tokenizer, 128, processor=processor
    )
    batch = collate_prompts([dataset[i] for i in range(len(dataset))], engine.pad_token_id)
    tensors = {key: batch.pop(key) for key in ("input_ids", "attention_mask", "position_ids")}
    from_dataset = engine.generate_sequences(DataProto.from_dict(tensors=tensors, non_tensors=batch))
    by_hand = engine.generate_sequences(left_padded(row_inputs(processor), engine.pad_token_id))
    assert torch.equal(from_dataset.batch["input_ids"], by_hand.batch["input_ids"])
    assert engine_responses(from_dataset) == engine_responses(by_hand)


def test_prompt_dataset_with_a_processor_needs_the_images_column(processor, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from hybridflow.data.prompt_dataset import PromptDataset

    path = tmp_path / "text.parquet"
    rows = [
        {
            "prompt": [{"role": "user", "content": "2+3?"}],
            "data_source": "s",
            "reward_model": {"ground_truth": "5"},
        }
    ]
    pq.write_table(pa.Table.from_pylist(rows), path)
    with pytest.raises(ValueError, match=r"text.parquet lacks columns \['images'\]"):
        PromptDataset([str(path)], processor.tokenizer, 128, processor=processor)


def test_prompt_dataset_names_the_row_with_a_bad_image(processor, tmp_path):
    from hybridflow.data.prompt_dataset import PromptDataset

    path = write_image_rows(tmp_path / "bad.parquet", [ROWS[0], ("<image>?", [b"not an image"])])
    with pytest.raises(ValueError, match=r"bad.parquet row 1: `images\[0\]` is not an image PIL reads"):
        PromptDataset([path], processor.tokenizer, 128, processor=processor)


def test_tools_reach_the_processors_chat_template(vlm):
    """An agent recipe's tool schemas are rendered into image prompts as into text ones."""
    from transformers import AutoProcessor

    from hybridflow.data.prompt_dataset import PromptDataset

    processor = AutoProcessor.from_pretrained(vlm)
    processor.chat_template = (
        "{% for tool in tools or [] %}[tool {{ tool.function.name }}]{% endfor %}"
        "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}<|assistant|>"
    )
    tools = [{"type": "function", "function": {"name": "count", "parameters": {"type": "object"}}}]
    path = write_image_rows(vlm.parent / "tools.parquet", ROWS[:1])
    with_tools = PromptDataset([path], processor.tokenizer, 256, tools=tools, processor=processor)
    without = PromptDataset([path], processor.tokenizer, 256, processor=processor)
    text = processor.tokenizer.decode(with_tools[0]["input_ids"])
    assert text.startswith("[tool count]") and text.endswith(
        processor.tokenizer.decode(without[0]["input_ids"])
    )
