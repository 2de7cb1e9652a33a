"""The tiny model directory loads with transformers' Auto classes, tokenizes text one character
per token, renders the chat template, and generates."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hybridflow.utils.tiny_model import make_tiny_model


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
    assert not (tmp_path / "x").exists()
