"""Bad models and layouts fail with a ValueError naming the problem, before any process group exists."""

import json

import pytest
import torch.distributed as dist
from tiny_hf import make_tiny_hf_checkpoint

from engines.megatron.build import build_model
from engines.megatron.config import MegatronConfig
from engines.megatron.model import load_hf_config
from engines.megatron.parallel import init_megatron, validate_parallel_layout


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    # 4 heads, 2 KV heads, 4 layers, intermediate 128
    return make_tiny_hf_checkpoint(tmp_path_factory.mktemp("qwen"), arch="qwen2")


def rewrite_config(src, dst, **changes):
    dst.mkdir()
    config = json.loads((src / "config.json").read_text())
    config.update(changes)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_unsupported_architecture_is_named_with_the_supported_list(qwen_dir, tmp_path):
    gpt2 = rewrite_config(qwen_dir, tmp_path / "gpt2", architectures=["GPT2LMHeadModel"])
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel.*supported.*LlamaForCausalLM.*Qwen2ForCausalLM"):
        build_model(gpt2, MegatronConfig())
    assert not dist.is_initialized()


def test_missing_config_is_named(tmp_path):
    with pytest.raises(ValueError, match=r"no config\.json"):
        load_hf_config(tmp_path)


def test_a_vision_language_model_given_to_the_text_loader_names_where_it_trains(qwen_dir, tmp_path):
    # A LLaVA config.json holds its language model under text_config: the text loader's list of
    # missing fields would mislead, so it says what the directory is and where such a model trains.
    text = json.loads((qwen_dir / "config.json").read_text())
    llava = rewrite_config(
        qwen_dir, tmp_path / "llava", architectures=["LlavaForConditionalGeneration"], model_type="llava",
        text_config=text, vision_config={"model_type": "clip_vision_model"},
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"LlavaForConditionalGeneration is a vision-language model.*policy"):
        load_hf_config(llava)


def test_unsupported_rope_scaling_is_named(qwen_dir, tmp_path):
    scaled = rewrite_config(
        qwen_dir, tmp_path / "yarn", rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}
    )
    with pytest.raises(ValueError, match="rope type 'yarn'"):
        load_hf_config(scaled)


@pytest.mark.parametrize(
    ("tp", "pp", "message"),
    [
        (3, 1, r"tensor_model_parallel_size=3 must divide num_attention_heads=4"),
        (8, 1, r"tensor_model_parallel_size=8 must divide num_attention_heads=4"),
        (1, 3, r"pipeline_model_parallel_size=3 must divide num_hidden_layers=4"),
        (0, 1, r"tensor_model_parallel_size must be a positive integer"),
    ],
)
def test_bad_layouts_fail_before_any_process_group(qwen_dir, tp, pp, message):
    cfg = MegatronConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    with pytest.raises(ValueError, match=message):
        build_model(qwen_dir, cfg)
    with pytest.raises(ValueError, match=message):
        init_megatron(cfg, load_hf_config(qwen_dir))
    assert not dist.is_initialized()


def test_kv_heads_must_divide_tp_or_be_divided_by_it(qwen_dir, tmp_path):
    # 12 heads, 3 KV heads: TP=2 neither divides 3 nor is a multiple of it; TP=6 is (sharing rule).
    odd = load_hf_config(
        rewrite_config(
            qwen_dir, tmp_path / "kv3", num_attention_heads=12, num_key_value_heads=3, intermediate_size=192
        )
    )
    with pytest.raises(ValueError, match=r"tensor_model_parallel_size=2 must divide num_key_value_heads=3"):
        validate_parallel_layout(odd, 2, 1)
    validate_parallel_layout(odd, 6, 1)
    validate_parallel_layout(odd, 3, 2)


def test_intermediate_size_must_split_over_tp(qwen_dir, tmp_path):
    odd = load_hf_config(rewrite_config(qwen_dir, tmp_path / "ffn", intermediate_size=130))
    with pytest.raises(ValueError, match=r"tensor_model_parallel_size=4 must divide intermediate_size=130"):
        validate_parallel_layout(odd, 4, 1)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    # 4 experts of intermediate size 32, top-2
    return make_tiny_hf_checkpoint(tmp_path_factory.mktemp("moe"), arch="qwen3_moe")


@pytest.mark.parametrize(
    ("ep", "etp", "message"),
    [
        (3, 1, r"expert_model_parallel_size=3 must divide the number of experts 4"),
        (8, 1, r"expert_model_parallel_size=8 must divide the number of experts 4"),
        (2, 3, r"expert_tensor_parallel_size=3 must divide the expert intermediate size 32"),
        (0, 1, r"expert_model_parallel_size must be a positive integer"),
    ],
)
def test_experts_must_split_over_ep_before_any_process_group(moe_dir, ep, etp, message):
    cfg = MegatronConfig(expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
    with pytest.raises(ValueError, match=message):
        build_model(moe_dir, cfg)
    with pytest.raises(ValueError, match=message):
        init_megatron(cfg, load_hf_config(moe_dir))
    assert not dist.is_initialized()
    validate_parallel_layout(load_hf_config(moe_dir), 1, 1, 4, 2)


def test_expert_parallelism_needs_a_mixture_of_experts(qwen_dir):
    with pytest.raises(ValueError, match=r"expert_model_parallel_size=2 needs a mixture-of-experts model"):
        validate_parallel_layout(load_hf_config(qwen_dir), 1, 1, 2)


def test_moe_training_at_tp2_needs_sequence_parallel(moe_dir):
    from engines.megatron.parallel import validate_moe_training

    moe = load_hf_config(moe_dir)
    with pytest.raises(ValueError, match=r"tensor_model_parallel_size=2 needs sequence_parallel=true"):
        validate_moe_training(moe, MegatronConfig(tensor_model_parallel_size=2))
    validate_moe_training(moe, MegatronConfig(tensor_model_parallel_size=2, sequence_parallel=True))
    validate_moe_training(moe, MegatronConfig(expert_model_parallel_size=2))


def test_qwen3_moe_with_dense_layers_is_refused(moe_dir, tmp_path):
    mixed = rewrite_config(moe_dir, tmp_path / "mixed", mlp_only_layers=[0])
    with pytest.raises(ValueError, match=r"mlp_only_layers"):
        load_hf_config(mixed)
