"""Adapter-only weight sync into the `vllm` engine (real, vLLM's CPU build), fed by a Megatron
actor with LoRA adapters at TP 2 into one vLLM engine at TP 2 (see `_vllm_lora_worker.py` for
each check), and the plain functions that decide its engine settings and refusals."""

import re
import sys
from pathlib import Path

import pytest

from engines.rollout.vllm_lora import adapter_sync_problems, lora_engine_args, sleep_level, vllm_max_lora_rank

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "megatron"))
from launch import run_distributed
from tiny_hf import ascii_vocab_size, make_tiny_hf_checkpoint

WORKER = Path(__file__).resolve().parent / "_vllm_lora_worker.py"


@pytest.mark.slow
def test_adapter_only_sync_generates_what_a_merged_sync_does(tmp_path):
    # head size 32 (hidden 128, 4 heads): the smallest vLLM's CPU attention supports
    checkpoint = make_tiny_hf_checkpoint(
        tmp_path / "hf", hidden_size=128, intermediate_size=256, vocab_size=ascii_vocab_size()
    )
    output = run_distributed(WORKER, 2, checkpoint, tmp_path, timeout=600)
    for check in ("adapters-equal-merged", "adapters-only", "version-moves", "unknown-module"):
        assert f"OK {check}" in output, f"check {check!r} did not pass:\n{output[-4000:]}"


def test_max_lora_rank_is_the_smallest_vllm_rank_that_holds_the_adapters():
    assert [vllm_max_lora_rank(rank) for rank in (1, 4, 8, 9, 64, 300, 512)] == [1, 8, 8, 16, 64, 320, 512]
    with pytest.raises(ValueError, match=r"actor.lora.rank=513 .*or actor.lora.sync=merged"):
        vllm_max_lora_rank(513)


def test_engine_settings_come_from_actor_lora_and_the_recipe_may_not_set_them():
    assert lora_engine_args(16, {"max_model_len": 64}) == {
        "enable_lora": True,
        "max_lora_rank": 16,
        "max_loras": 1,
        "max_cpu_loras": 1,
    }
    with pytest.raises(ValueError, match=r"rollout.vllm sets \['max_lora_rank'\].*remove them"):
        lora_engine_args(16, {"max_lora_rank": 64})
    # on CUDA the engine keeps the base weights between rollouts only when adapters are synced alone
    assert (sleep_level(16), sleep_level(0)) == (1, 2)


@pytest.mark.parametrize(
    ("settings", "expected"),
    [
        ({"rank": 0}, "set actor.lora.rank > 0"),
        ({"rollout_name": "hf"}, "rollout.name=hf: the hf engine has no LoRA loading"),
        ({"rollout_name": "sglang"}, "rollout.name=sglang: SGLang's LoRA loading is not wired"),
        ({"vllm_args": {"enable_lora": True}}, r"rollout.vllm sets \['enable_lora'\]"),
        ({"agent_loop": "tool_agent"}, "rollout.agent.loop=tool_agent: request-level"),
        ({"placement": "disaggregated"}, "trainer.placement=disaggregated"),
        ({"rank": 1024}, "above vLLM's largest LoRA rank 512"),
    ],
)
def test_adapter_sync_is_refused_where_it_cannot_work(settings, expected):
    good = {"rank": 16, "rollout_name": "vllm", "vllm_args": {}, "agent_loop": "single_turn"}
    assert adapter_sync_problems(**good, placement="colocated") == []
    args = {**good, "placement": "colocated", **settings}
    problems = adapter_sync_problems(**args)
    assert len(problems) == 1
    assert re.search(expected, problems[0]), problems


@pytest.mark.usefixtures("in_quickstart_working_tree")
def test_recipe_validation_refuses_adapter_sync_without_vllm_and_unknown_modes():
    from hybridflow.checks.recipe import RecipeError, validate_recipe
    from hybridflow.config.loader import load_recipe

    quickstart = Path(__file__).resolve().parents[2] / "recipes" / "quickstart.yaml"
    lora = ["actor.lora.rank=4", "rollout.name=hf"]
    with pytest.raises(RecipeError, match=r"actor.lora.sync=adapters with rollout.name=hf: the hf engine"):
        validate_recipe(load_recipe(quickstart, [*lora, "actor.lora.sync=adapters"]), cuda_available=False)
    with pytest.raises(ValueError, match=r"actor.lora.sync.*'merged', 'adapters'"):
        load_recipe(quickstart, [*lora, "actor.lora.sync=both"])
