"""The `vllm` rollout engine on image prompts: vLLM's CPU build, through its Transformers
backend (`rollout.vllm.model_impl: transformers`, engines/rollout/vllm_images.py), with the tiny
random LLaVA model. One engine for the module, in a process of its own (_vllm_vlm_worker.py),
started from random weights (`load_format=dummy`) and given the checkpoint's tensors by the
weight-update session, vision tower and projector included.

The references are transformers itself, row by row without padding (image_rows.reference_greedy),
and the hf engine on the same left-padded batch.
"""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from image_rows import (
    RED_CIRCLE,
    ROWS,
    engine_responses,
    greedy_rollout_config,
    left_padded,
    reference_greedy,
    row_inputs,
)
from launch import run_distributed

from engines.rollout.vllm_images import check_image_engine_args, collapse_placeholders, vllm_prompts
from hybridflow.protocol import PIXEL_VALUES_KEY
from hybridflow.utils.tiny_vlm import make_tiny_vlm

WORKER = Path(__file__).resolve().parent / "_vllm_vlm_worker.py"


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    # head size 32 (64 / 2 heads): vLLM's CPU attention has no kernel for the default's 16
    return make_tiny_vlm(tmp_path_factory.mktemp("tiny_vlm"), text_heads=2, text_kv_heads=1)


@pytest.fixture(scope="module")
def hf_config(vlm):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(vlm)


@pytest.fixture(scope="module")
def processor(vlm):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(vlm)


@pytest.fixture(scope="module")
def references(vlm, processor) -> dict[str, list[list[int]]]:
    """transformers' greedy responses to ROWS, row by row, and the hf engine's on the batch."""
    from transformers import AutoModelForImageTextToText

    from engines.rollout.hf_rollout import HFRolloutEngine

    hf = HFRolloutEngine(vlm, greedy_rollout_config("hf"), device="cpu")
    inputs = row_inputs(processor)
    reference = AutoModelForImageTextToText.from_pretrained(vlm, dtype=torch.float32).eval()
    return {
        "transformers": reference_greedy(reference, inputs, hf.eos_token_ids, hf.pad_token_id),
        "hf": engine_responses(hf.generate_sequences(left_padded(inputs, hf.pad_token_id))),
    }


@pytest.fixture(scope="module")
def vllm_run(vlm, tmp_path_factory) -> dict:
    """The one vLLM engine of the module, in its own process (_vllm_vlm_worker.py says why)."""
    out = tmp_path_factory.mktemp("vllm_vlm") / "result.json"
    output = run_distributed(WORKER, 1, vlm, out, timeout=600)
    assert "OK vllm-vlm" in output, output[-4000:]
    return json.loads(out.read_text())


def test_synced_engine_generates_from_image_prompts_as_transformers_and_the_hf_engine(vllm_run, references):
    assert vllm_run["responses"] == references["transformers"]
    assert vllm_run["responses"] == references["hf"]
    assert any(len(images) > 1 for _, images in ROWS) and any(not images for _, images in ROWS)


def test_the_images_reach_the_model(vllm_run):
    """The same text with the two rows' images swapped gives other log-probs for those rows."""
    first = torch.tensor(vllm_run["first_log_probs"])  # (2,): the same prompt tokens, other pixels
    swapped = torch.tensor(vllm_run["first_log_probs_swapped"])
    assert (first - swapped.flip(0)).abs().max() < 1e-5
    assert (first[0] - first[1]).abs() > 1e-4


def test_each_image_goes_to_vllm_as_one_placeholder_with_its_processed_pixels(processor, hf_config):
    inputs = row_inputs(processor)
    requests = vllm_prompts(left_padded(inputs, 0), hf_config)
    image_token = hf_config.image_token_id
    for (_, images), (ids, pixels), request in zip(ROWS, inputs, requests, strict=True):
        assert request["prompt_token_ids"].count(image_token) == len(images)
        assert len(request["prompt_token_ids"]) == len(ids) - 15 * len(images)  # 16 features per image
        sent = request.get("multi_modal_data", {}).get("image", [])
        assert [image.shape for image in sent] == [(3, 32, 32)] * len(images)
        assert all(torch.equal(image, torch.as_tensor(p)) for image, p in zip(sent, pixels, strict=True))


def test_collapse_keeps_one_placeholder_per_image_and_every_other_token():
    assert collapse_placeholders([1, 9, 9, 9, 9, 2, 9, 9, 3], image_token_id=9, per_image=2) == [
        1,
        9,
        9,
        2,
        9,
        3,
    ]


def test_a_row_whose_placeholders_do_not_match_its_pixels_is_refused(processor, hf_config):
    inputs = row_inputs(processor, [("<image>How many?", [RED_CIRCLE])])
    prompts = left_padded(inputs, 0)
    two = np.empty(1, dtype=object)
    two[0] = np.concatenate([inputs[0][1], inputs[0][1]])  # (2, 3, 32, 32) for one placeholder run
    prompts.non_tensor_batch[PIXEL_VALUES_KEY] = two
    with pytest.raises(
        ValueError, match=r"prompt row 0 holds 16 image tokens for 2 images; .* writes 16 per image"
    ):
        vllm_prompts(prompts, hf_config)


def test_vllms_own_llava_is_refused_naming_the_setting():
    with pytest.raises(ValueError, match=r"vision-language model: set rollout.vllm.model_impl: transformers"):
        check_image_engine_args({"model": "m"})
    with pytest.raises(ValueError, match=r"model_impl: transformers"):
        check_image_engine_args({"model": "m", "model_impl": "vllm"})
    check_image_engine_args({"model": "m", "model_impl": "transformers"})


OWN_LLAVA = (
    "rollout.name=vllm with a vision-language model: set rollout.vllm.model_impl: transformers (vLLM's "
    "own LLaVA takes other weight names than the sync streams, and needs torchvision: docs/vlm.md)"
)


@pytest.mark.parametrize(
    ("overrides", "problem"),
    [
        (["rollout.name=vllm", "rollout.vllm.model_impl=transformers"], None),
        (["rollout.name=hf", "rollout.verify_weight_sync=true"], None),
        (
            ["rollout.name=vllm", "rollout.vllm.model_impl=transformers", "rollout.verify_weight_sync=true"],
            "rollout.verify_weight_sync=true: with vllm the check scores text tokens through the actor",
        ),
        (["rollout.name=vllm"], OWN_LLAVA),
        (
            ["rollout.name=sglang"],
            "rollout.name=sglang: image prompts generate with the hf and vllm engines only so far; set "
            "rollout.name: hf or vllm",
        ),
    ],
)
@pytest.mark.usefixtures("in_quickstart_working_tree")  # the shipped recipe, read as a user's run would
def test_a_vision_language_recipe_names_the_engines_it_can_use(overrides, problem):
    from hybridflow.checks.vlm import vision_language_problems
    from hybridflow.config.loader import load_recipe

    recipe = Path(__file__).resolve().parents[2] / "recipes/vlm_quickstart.yaml"
    problems = vision_language_problems(load_recipe(recipe, overrides), "vlm")
    assert len(problems) == (problem is not None), problems
    assert all(p.startswith(f"model.path=vlm is a vision-language model: {problem}") for p in problems)
