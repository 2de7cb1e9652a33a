"""Tiny random Hugging Face checkpoints (Llama, Qwen2, Qwen3, Qwen3-MoE, Mixtral) built locally
for the engine tests.

`make_tiny_hf_checkpoint(out_dir, arch="qwen2")` writes config.json, sharded safetensors with
their index (always at least two shards) and a character-level tokenizer, so that tests exercise
the same loading path as a real downloaded model. Nothing is downloaded.

Import from a test with `from tiny_hf import make_tiny_hf_checkpoint` (pytest puts this folder
on sys.path; so does torchrun for worker scripts that live here).
"""

import json
import string
from pathlib import Path

import torch

SPECIAL_TOKENS = ["<pad>", "<eos>", "<bos>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def _byte_level_char(byte: int) -> str:
    """GPT-2's byte-to-unicode map (what the ByteLevel pre-tokenizer emits), for one byte."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    if byte in printable:
        return chr(byte)
    return chr(256 + [b for b in range(256) if b not in printable].index(byte))


def char_vocab() -> dict[str, int]:
    """Special tokens first (pad=0, eos=1, bos=2), then one token per printable ASCII character."""
    chars = [c for c in string.printable if c not in "\x0b\x0c\r"]
    return {tok: i for i, tok in enumerate(SPECIAL_TOKENS + [_byte_level_char(ord(c)) for c in chars])}


def make_char_tokenizer():
    """A fast character-level tokenizer: byte-level BPE with no merges.

    Byte-level because transformers' Qwen2/Llama tokenizer classes (picked by AutoTokenizer from
    config.json's model_type) impose a ByteLevel pre-tokenizer on load.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE(vocab=char_vocab(), merges=[], unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def tiny_hf_config(
    arch: str = "qwen2",
    num_layers: int = 4,
    hidden_size: int = 64,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    vocab_size: int = 200,
    tie_word_embeddings: bool = False,
    rope_theta: float = 10000.0,
    rms_norm_eps: float = 1e-6,
    num_experts: int = 4,
    num_experts_per_tok: int = 2,
    moe_intermediate_size: int = 32,
    norm_topk_prob: bool = False,
):
    """The transformers config of a tiny model; `arch` is "qwen2" (QKV bias), "llama", "qwen3"
    (QK norm), "qwen3_moe" or "mixtral" (the last two use the num_experts... arguments; Mixtral's
    experts are intermediate_size wide and always renormalise the top-k probabilities)."""
    from transformers import LlamaConfig, MixtralConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

    common = dict(
        num_hidden_layers=num_layers,
        hidden_size=hidden_size,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        vocab_size=vocab_size,
        tie_word_embeddings=tie_word_embeddings,
        rope_theta=rope_theta,
        rms_norm_eps=rms_norm_eps,
        max_position_embeddings=512,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
    )
    if arch == "qwen2":
        return Qwen2Config(**common, architectures=["Qwen2ForCausalLM"])
    if arch == "llama":
        return LlamaConfig(**common, architectures=["LlamaForCausalLM"])
    head_dim = hidden_size // num_heads  # Qwen3's default head_dim is 128 whatever the width
    if arch == "qwen3":
        return Qwen3Config(**common, head_dim=head_dim, architectures=["Qwen3ForCausalLM"])
    if arch == "qwen3_moe":
        return Qwen3MoeConfig(
            **common,
            head_dim=head_dim,
            num_experts=num_experts,
            num_experts_per_tok=num_experts_per_tok,
            moe_intermediate_size=moe_intermediate_size,
            norm_topk_prob=norm_topk_prob,
            architectures=["Qwen3MoeForCausalLM"],
        )
    if arch == "mixtral":
        return MixtralConfig(
            **common,
            num_local_experts=num_experts,
            num_experts_per_tok=num_experts_per_tok,
            architectures=["MixtralForCausalLM"],
        )
    raise ValueError(f"arch must be one of qwen2, llama, qwen3, qwen3_moe, mixtral; got {arch!r}")


def make_tiny_hf_checkpoint(out_dir, seed: int = 0, with_tokenizer: bool = True, **config_kwargs) -> Path:
    """Write a random fp32 checkpoint to `out_dir` and return it as a Path.

    `config_kwargs` are `tiny_hf_config`'s (arch, num_layers, hidden_size, ...). Weights are drawn
    with std 0.2 (biases and norms included) so that layouts that are wrong show up as large logit
    differences rather than hiding under near-zero initialisation.
    """
    from transformers import AutoModelForCausalLM

    out = Path(out_dir)
    config = tiny_hf_config(**config_kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            else:
                param.copy_(0.2 * torch.randn_like(param))
    total_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    model.save_pretrained(out, max_shard_size=max(total_bytes // 3, 1), safe_serialization=True)
    if with_tokenizer:
        make_char_tokenizer().save_pretrained(out)
    _assert_sharded(out)
    return out


def _assert_sharded(out: Path) -> None:
    index_file = out / "model.safetensors.index.json"
    if not index_file.exists():
        raise RuntimeError(f"expected a sharded checkpoint in {out}, found no index json")
    shards = set(json.loads(index_file.read_text())["weight_map"].values())
    if len(shards) < 2:
        raise RuntimeError(f"expected at least two shards in {out}, got {sorted(shards)}")


def padded_batch(
    prompt_lengths: list[int],
    response_lengths: list[int],
    prompt_len: int,
    response_len: int,
    vocab_size: int,
    seed: int = 0,
) -> dict[str, torch.Tensor]:
    """A batch shaped like a rollout's: left-padded prompts then right-padded responses.

    Returns input_ids, attention_mask, position_ids (B, P+R) and responses, response_mask (B, R).
    Pad positions hold token 0; real tokens are drawn from [3, vocab_size).
    """
    gen = torch.Generator().manual_seed(seed)
    batch = len(prompt_lengths)
    total = prompt_len + response_len
    input_ids = torch.zeros(batch, total, dtype=torch.long)
    attention_mask = torch.zeros(batch, total, dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompt_lengths, response_lengths, strict=True)):
        real = slice(prompt_len - p, prompt_len + r)
        input_ids[i, real] = torch.randint(3, vocab_size, (p + r,), generator=gen)
        attention_mask[i, real] = 1
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": position_ids,
        "responses": input_ids[:, prompt_len:],
        "response_mask": attention_mask[:, prompt_len:],
    }
