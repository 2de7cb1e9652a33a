"""The LLaVA pieces without process groups: the tiny VLM's processor, image-token collapsing, the
vision tower's fused QKV shards, and what the config and weight plan refuse."""

import json
import re
from contextlib import ExitStack

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from engines.megatron.config import MegatronConfig
from engines.megatron.qkv_layout import split_fused_qkv
from engines.megatron.vlm import collapse_image_tokens, llava_attention_mask, micro_batch_images
from engines.megatron.vlm_config import load_vlm_config
from engines.megatron.vlm_weights import read_vision_shard, vision_plans, vlm_plan
from engines.megatron.weights import SafetensorsReader
from hybridflow.utils.tiny_vlm import IMAGE_TOKEN, make_tiny_vlm


@pytest.fixture(scope="module")
def tiny_vlm(tmp_path_factory):
    return make_tiny_vlm(tmp_path_factory.mktemp("tiny_vlm"))


def test_processor_expands_each_image_to_the_models_feature_count(tiny_vlm):
    from PIL import Image
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(tiny_vlm)
    vlm = load_vlm_config(tiny_vlm)
    image = Image.new("RGB", (50, 40), "red")
    ids = processor(text=[f"a{IMAGE_TOKEN}b"], images=[image], return_tensors="pt")["input_ids"]
    assert (ids == vlm.image_token_id).sum() == vlm.image_feature_count == 16  # (32 / 8)^2, CLS dropped
    assert vlm.vision_layers_used == 2  # hidden state -2 of a 3-layer tower


def test_collapse_keeps_one_image_token_per_image():
    img, n = 9, 3
    ids = torch.tensor([[1, img, img, img, 2, img, img, img], [img, img, img, img, img, img, 4, 5]])
    assert collapse_image_tokens(ids, img, n).tolist() == [[1, img, 2, img], [img, img, 4, 5]]


# Three rows of 6 ids with 2, 1 and 0 images of 2 tokens each (image token 9).
MIXED_IDS = torch.tensor([[5, 9, 9, 1, 9, 9], [6, 7, 9, 9, 2, 3], [4, 4, 4, 4, 4, 3]])


def test_collapse_right_pads_rows_with_fewer_images():
    assert collapse_image_tokens(MIXED_IDS, 9, 2, pad_token_id=0).tolist() == [
        [5, 9, 1, 9, 0, 0],
        [6, 7, 9, 2, 3, 0],
        [4, 4, 4, 4, 4, 3],
    ]


def test_attention_mask_covers_the_longest_combined_row():
    # LLaVAModel makes rows of 6 + 2, 6 + 1 and 6 + 0 positions from the collapsed rows of 6 ids,
    # padded to 8: the mask gains 2 padded positions (2 - 0 images, 2 - 1 extra tokens each).
    mask = torch.tensor([[1] * 6, [0, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1]])
    extended = llava_attention_mask(mask, MIXED_IDS, 9, 2)
    assert extended.tolist() == [[*row, 0, 0] for row in mask.tolist()]


def test_micro_batch_images_keep_row_order_and_skip_rows_without_images():
    rows = [
        np.full((1, 3, 2, 2), 1.0),
        np.zeros((0, 3, 1, 1)),
        np.full((2, 3, 2, 2), 2.0),
        np.zeros((0, 3, 1, 1)),
    ]
    first, second = micro_batch_images(rows, 2)
    assert first.shape == (1, 3, 2, 2) and first.eq(1).all()
    assert second.shape == (2, 3, 2, 2) and second.eq(2).all()
    none_at_all = micro_batch_images(rows[1::2], 2)
    assert [images.shape[0] for images in none_at_all] == [0]


def test_collapse_refuses_a_partial_image():
    with pytest.raises(ValueError, match="each image must be 2 tokens"):
        collapse_image_tokens(torch.tensor([[9, 9, 1, 2], [9, 9, 9, 1]]), 9, 2)


def per_head_fused(q, k, v, heads):
    """Megatron's fused QKV with one KV head per head: [q_h; k_h; v_h] for each head h."""
    rows = [t.chunk(heads) for t in (q, k, v)]
    return torch.cat([torch.cat([rq, rk, rv]) for rq, rk, rv in zip(*rows, strict=True)])


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_vision_qkv_shards_are_chunks_of_the_per_head_layout(tiny_vlm, tp):
    vlm = load_vlm_config(tiny_vlm)
    plan = next(p for p in vision_plans(vlm) if p.kind == "qkv" and p.megatron_name.endswith("weight"))
    with ExitStack() as stack:
        reader = SafetensorsReader(tiny_vlm, stack)
        q, k, v = (reader.full(n, (32, 32)) for n in plan.hf_names)
        shards = [read_vision_shard(reader, vlm, plan, r, tp) for r in range(tp)]
    fused = per_head_fused(q, k, v, vlm.vision.num_heads)
    assert torch.equal(torch.cat(shards), fused)
    split = split_fused_qkv(fused, vlm.vision.num_heads, 1, vlm.vision.head_dim)
    assert all(torch.equal(a, b) for a, b in zip(split, (q, k, v), strict=True))


def test_plan_refuses_a_tensor_it_cannot_place(tiny_vlm):
    vlm = load_vlm_config(tiny_vlm)
    names = [n for p in vision_plans(vlm) for n in p.hf_names] + ["vision_tower.vision_model.extra.weight"]
    with pytest.raises(ValueError, match=re.escape("vision_tower.vision_model.extra.weight")):
        vlm_plan(vlm, MegatronConfig(), names)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"vision_feature_layer": [-2, -1]}, "list of vision_feature_layer"),
        ({"vision_feature_layer": 0}, "vision_feature_layer=0 selects no layer output"),
        ({"projector_hidden_act": "relu"}, "GELU projector"),
        ({"vision_config": {"model_type": "siglip_vision_model"}}, "CLIP vision tower"),
    ],
)
def test_config_refuses_what_the_model_does_not_build(tiny_vlm, tmp_path, change, message):
    raw = json.loads((tiny_vlm / "config.json").read_text())
    for key, value in change.items():
        raw[key] = {**raw[key], **value} if isinstance(value, dict) else value
    (tmp_path / "config.json").write_text(json.dumps(raw))
    save_file({}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=message):
        load_vlm_config(tmp_path)
