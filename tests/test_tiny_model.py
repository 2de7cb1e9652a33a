"""The tiny model directory loads with transformers' Auto classes, tokenizes text one character
per token, renders the chat template, and generates; every architecture builds, and the engine
tests' options (sharded safetensors, std-0.2 weights) do what they say."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hybridflow.utils.tiny_model import ARCHS, MOE_ARCHS, make_tiny_model


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), seed=3)


def test_tokenizer_round_trips_text_one_token_per_ascii_character(tiny_dir):
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    text = "What is 23+48?\n23+48=71\n#### 71"
    ids = tok(text)["input_ids"]
    assert len(ids) == len(text)
    assert tok.decode(ids) == text
    assert len(set(ids)) == len(set(text))  # distinct characters get distinct ids


def test_tokenizer_handles_gsm8k_unicode(tiny_dir):
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    text = "Janet’s ducks lay 16 eggs — $2 each."
    ids = tok(text)["input_ids"]
    assert tok.unk_token_id not in ids
    assert tok.decode(ids) == text


def test_special_ids_agree_across_tokenizer_config_and_generation_config(tiny_dir):
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    config = json.loads((tiny_dir / "config.json").read_text())
    generation = json.loads((tiny_dir / "generation_config.json").read_text())
    assert len({tok.pad_token_id, tok.eos_token_id, tok.bos_token_id}) == 3
    for cfg in (config, generation):
        assert cfg["eos_token_id"] == tok.eos_token_id
        assert cfg["pad_token_id"] == tok.pad_token_id
    assert config["vocab_size"] == len(tok)
    assert config["architectures"] == ["Qwen2ForCausalLM"]
    assert (tiny_dir / "model.safetensors").exists()


def test_chat_template_appends_assistant_prefix(tiny_dir):
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    messages = [{"role": "user", "content": "What is 1+2?"}]
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert prompt == "<|user|>What is 1+2?<|assistant|>"
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert ids[0] == tok.convert_tokens_to_ids("<|user|>")
    assert ids[-1] == tok.convert_tokens_to_ids("<|assistant|>")
    assert len(ids) == 2 + len("What is 1+2?")
    without = tok.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
    assert without == "<|user|>What is 1+2?"
    full = tok.apply_chat_template([*messages, {"role": "assistant", "content": "3"}], tokenize=False)
    assert full == "<|user|>What is 1+2?<|assistant|>3</s>"


def test_model_loads_and_generates_greedily_and_deterministically(tiny_dir):
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    assert model.config.num_hidden_layers == 4 and model.config.num_key_value_heads == 2
    prompts = ["<|user|>What is 1+2?<|assistant|>", "<|user|>Hi<|assistant|>"]
    batch = tok(prompts, return_tensors="pt", padding=True)
    assert batch["attention_mask"][1, 0] == 0  # left padding for generation
    with torch.no_grad():
        out1 = model.generate(**batch, max_new_tokens=8, do_sample=False)
        out2 = model.generate(**batch, max_new_tokens=8, do_sample=False)
    prompt_len = batch["input_ids"].shape[1]
    assert prompt_len < out1.shape[1] <= prompt_len + 8
    assert torch.equal(out1[:, :prompt_len], batch["input_ids"])
    assert torch.equal(out1, out2)


def test_same_seed_gives_same_weights_and_other_seed_differs(tmp_path):
    from safetensors.torch import load_file

    a = load_file(make_tiny_model(tmp_path / "a", seed=1, num_layers=2) / "model.safetensors")
    b = load_file(make_tiny_model(tmp_path / "b", seed=1, num_layers=2) / "model.safetensors")
    c = load_file(make_tiny_model(tmp_path / "c", seed=2, num_layers=2) / "model.safetensors")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])


def test_bad_settings_are_rejected_before_writing(tmp_path):
    with pytest.raises(ValueError, match="num_heads=4 must be divisible by num_kv_heads=3"):
        make_tiny_model(tmp_path / "x", num_kv_heads=3)
    with pytest.raises(TypeError, match="unknown settings \\['layers'\\]"):
        make_tiny_model(tmp_path / "y", layers=2)
    with pytest.raises(ValueError, match=r"arch must be one of qwen2, llama.*got 'gpt2'"):
        make_tiny_model(tmp_path / "x", arch="gpt2")
    with pytest.raises(ValueError, match="num_experts=4 needs arch 'qwen3_moe' or 'mixtral'"):
        make_tiny_model(tmp_path / "x", num_experts=4)
    with pytest.raises(ValueError, match="arch='mixtral' needs num_experts > 0"):
        make_tiny_model(tmp_path / "x", arch="mixtral")
    with pytest.raises(ValueError, match="vocab_size=5 must be 0"):
        make_tiny_model(tmp_path / "x", vocab_size=5)
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("arch", ARCHS)
def test_every_arch_loads_with_the_shared_tokenizer(arch, tmp_path):
    experts = 4 if arch in MOE_ARCHS else 0
    out = make_tiny_model(tmp_path, arch=arch, num_layers=1, hidden_size=32, num_experts=experts)
    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.model_type == arch
    assert model.config.vocab_size == len(tok)
    assert (model.config.pad_token_id, model.config.eos_token_id) == (tok.pad_token_id, tok.eos_token_id)
    if arch.startswith("qwen3"):  # Qwen3 configs default head_dim to 128 whatever the width
        assert model.config.head_dim == 32 // 4
    experts_in_config = getattr(model.config, "num_experts", None) or getattr(
        model.config, "num_local_experts", 0
    )
    assert experts_in_config == experts
    ids = tok("1+2=3", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        assert model(ids).logits.shape == (1, 5, len(tok))


def test_sharded_and_redrawn_weights(tmp_path):
    from safetensors.torch import load_file

    settings = dict(num_layers=2, hidden_size=64, intermediate_size=128, vocab_size=120, init_std=0.2, seed=5)
    sharded = make_tiny_model(tmp_path / "sharded", sharded=True, **settings)
    single = load_file(make_tiny_model(tmp_path / "single", **settings) / "model.safetensors")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 2
    assert not (sharded / "model.safetensors").exists()
    loaded = {}
    for shard in sorted(set(index["weight_map"].values())):
        loaded.update(load_file(sharded / shard))
    assert loaded.keys() == single.keys()
    assert all(torch.equal(loaded[k], single[k]) for k in single)
    embed = single["model.embed_tokens.weight"]  # (120, 64)
    assert embed.shape == (120, 64) and abs(embed.std().item() - 0.2) < 0.01
    norm = single["model.layers.0.input_layernorm.weight"]  # (64,)
    assert abs(norm.mean().item() - 1.0) < 0.05 and 0.05 < norm.std().item() < 0.15
    default = load_file(
        make_tiny_model(tmp_path / "default", **{**settings, "init_std": 0.0}) / "model.safetensors"
    )
    assert default["model.embed_tokens.weight"].std().item() < 0.05  # transformers' std 0.02
