"""Builds a tiny, randomly initialised Qwen2-shaped model with a one-token-per-character tokenizer
(or, with `num_experts > 0`, a Qwen3-MoE one: QK norm and a mixture of experts in every layer).

The result is an ordinary Hugging Face directory (config.json, generation_config.json,
model.safetensors, tokenizer.json, tokenizer_config.json with a chat template), so every
part of hybridflow loads it exactly as it would load a downloaded Qwen2 checkpoint. Tests
and the quickstart use it because no weights can be downloaded here.

    python scripts/make_tiny_model.py --out outputs/tiny_model
"""

from dataclasses import dataclass
from pathlib import Path

PAD_TOKEN = "<pad>"
EOS_TOKEN = "</s>"
BOS_TOKEN = "<s>"
UNK_TOKEN = "<unk>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
SPECIAL_TOKENS = (PAD_TOKEN, EOS_TOKEN, BOS_TOKEN, UNK_TOKEN, *ROLE_TOKENS)

# One role token, then the content; an assistant turn ends with EOS so the model learns to stop.
# add_generation_prompt appends the assistant prefix, which is where a response starts.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


@dataclass
class TinyModelConfig:
    """Shape of the tiny model. Defaults: 4 layers, hidden 128, GQA 4 query / 2 KV heads (~1.05 M
    parameters); divisible by TP 2 and PP 2 so the parallel tests can split it."""

    num_layers: int = 4
    hidden_size: int = 128
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 512
    max_position_embeddings: int = 512
    tie_word_embeddings: bool = False
    seed: int = 0
    num_experts: int = 0  # > 0: Qwen3MoeForCausalLM with this many experts per layer
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 128

    def validate(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size={self.hidden_size} must be divisible by num_heads={self.num_heads}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} must be divisible by num_kv_heads={self.num_kv_heads}"
            )
        for name in ("num_layers", "hidden_size", "intermediate_size", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_experts and not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok={self.num_experts_per_tok} must be in [1, {self.num_experts}]"
            )


def byte_vocab() -> dict[str, int]:
    """Special tokens first (pad=0, eos=1, bos=2, unk=3, role tokens), then one token per byte in
    GPT-2's byte-to-unicode alphabet. Printable ASCII characters are their own symbols, so ASCII
    text tokenizes one character per token; any other character (e.g. typographic quotes in
    GSM8K) becomes its UTF-8 bytes, so every string round-trips."""
    from tokenizers import pre_tokenizers

    byte_symbols = sorted(pre_tokenizers.ByteLevel.alphabet())  # printable ASCII first
    return {token: i for i, token in enumerate([*SPECIAL_TOKENS, *byte_symbols])}


def build_tokenizer():
    """A Qwen2 tokenizer (byte-level BPE) with no merges: one token per byte.

    Why not a WordLevel character vocabulary: for `model_type: qwen2` transformers'
    AutoTokenizer always builds `Qwen2Tokenizer` from the vocabulary, so the tokenizer must be
    one that Qwen2Tokenizer reproduces exactly.
    """
    from transformers import Qwen2Tokenizer

    tokenizer = Qwen2Tokenizer(
        vocab=byte_vocab(),
        merges=[],
        pad_token=PAD_TOKEN,
        eos_token=EOS_TOKEN,
        bos_token=BOS_TOKEN,
        unk_token=UNK_TOKEN,
        additional_special_tokens=list(ROLE_TOKENS),
        padding_side="left",  # prompts are left-padded for generation
        model_max_length=TinyModelConfig.max_position_embeddings,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_model(cfg: TinyModelConfig, tokenizer):
    """A randomly initialised `Qwen2ForCausalLM` (or `Qwen3MoeForCausalLM`), seeded, whose special
    ids match the tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig, Qwen2Config, Qwen3MoeConfig

    moe = dict(
        head_dim=cfg.hidden_size // cfg.num_heads,
        num_experts=cfg.num_experts,
        num_experts_per_tok=cfg.num_experts_per_tok,
        moe_intermediate_size=cfg.moe_intermediate_size,
        norm_topk_prob=True,  # as Qwen3-30B-A3B
    )
    config_class, extra = (Qwen3MoeConfig, moe) if cfg.num_experts else (Qwen2Config, {})
    hf_config = config_class(
        **extra,
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_word_embeddings,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    torch.manual_seed(cfg.seed)
    model = AutoModelForCausalLM.from_config(hf_config)
    model.generation_config = GenerationConfig(
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    return model


def make_tiny_model(out_dir: str | Path, **overrides) -> Path:
    """Writes the tiny model and tokenizer to `out_dir` and returns it.

    `overrides` are `TinyModelConfig` fields (num_layers, hidden_size, num_heads, num_kv_heads,
    intermediate_size, max_position_embeddings, tie_word_embeddings, seed). The same arguments
    always give the same weights.
    """
    unknown = set(overrides) - set(TinyModelConfig.__dataclass_fields__)
    if unknown:
        raise TypeError(
            f"make_tiny_model got unknown settings {sorted(unknown)}; "
            f"expected some of {sorted(TinyModelConfig.__dataclass_fields__)}"
        )
    cfg = TinyModelConfig(**overrides)
    cfg.validate()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    tokenizer.model_max_length = cfg.max_position_embeddings
    build_model(cfg, tokenizer).save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out
