"""Builds a tiny, randomly initialised model with a one-token-per-character tokenizer: by default a
Qwen2 (QKV bias); `arch` also gives a Llama, a Qwen3 (QK norm), a Qwen3-MoE or a Mixtral.

The result is an ordinary Hugging Face directory (config.json, generation_config.json,
safetensors, tokenizer.json, tokenizer_config.json with a chat template), so every part of
hybridflow loads it exactly as it would load a downloaded checkpoint. Tests and the quickstart
use it because no weights can be downloaded here; the engine tests' shapes and options are in
tests/megatron/tiny_hf.py.

    python scripts/make_tiny_model.py --out outputs/tiny_model
"""

import json
from dataclasses import dataclass
from pathlib import Path

PAD_TOKEN = "<pad>"
EOS_TOKEN = "</s>"
BOS_TOKEN = "<s>"
UNK_TOKEN = "<unk>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
SPECIAL_TOKENS = (PAD_TOKEN, EOS_TOKEN, BOS_TOKEN, UNK_TOKEN, *ROLE_TOKENS)
ARCHS = ("qwen2", "llama", "qwen3", "qwen3_moe", "mixtral")
MOE_ARCHS = ("qwen3_moe", "mixtral")

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
    """Shape of the tiny model. Defaults: a Qwen2 of 4 layers, hidden 128, GQA 4 query / 2 KV heads
    (~1.05 M parameters); divisible by TP 2 and PP 2 so the parallel tests can split it.

    The MoE archs put experts in every layer: "qwen3_moe" experts are moe_intermediate_size wide
    and renormalise the top-k probabilities when norm_topk_prob is set (as Qwen3-30B-A3B);
    "mixtral" experts are intermediate_size wide and always renormalise."""

    arch: str = "qwen2"  # one of ARCHS
    num_layers: int = 4
    hidden_size: int = 128
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 512
    max_position_embeddings: int = 512
    vocab_size: int = 0  # 0: the tokenizer's (263); other sizes test vocabulary padding
    tie_word_embeddings: bool = False
    seed: int = 0
    init_std: float = 0.0  # 0: transformers' initialisation; > 0: see `redraw_weights`
    num_experts: int = 0  # experts per layer; > 0 exactly when arch is one of MOE_ARCHS
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 128
    norm_topk_prob: bool = True
    # multi-character tokens after the bytes (a BPE vocabulary's pieces, e.g. "<tool_call>")
    added_tokens: tuple[str, ...] = ()

    def validate(self) -> None:
        if self.arch not in ARCHS:
            raise ValueError(f"arch must be one of {', '.join(ARCHS)}; got {self.arch!r}")
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
        if self.vocab_size and self.vocab_size < len(SPECIAL_TOKENS):
            raise ValueError(
                f"vocab_size={self.vocab_size} must be 0 (the tokenizer's) or hold the "
                f"{len(SPECIAL_TOKENS)} special tokens"
            )
        if self.init_std < 0:
            raise ValueError(f"init_std must be >= 0 (0: transformers' initialisation), got {self.init_std}")
        self._validate_experts()

    def _validate_experts(self) -> None:
        moe = self.arch in MOE_ARCHS
        if moe and self.num_experts <= 0:
            raise ValueError(f"arch={self.arch!r} needs num_experts > 0, got {self.num_experts}")
        if not moe and self.num_experts:
            raise ValueError(
                f"num_experts={self.num_experts} needs arch 'qwen3_moe' or 'mixtral'; "
                f"arch={self.arch!r} is dense (num_experts=0)"
            )
        if moe and not 1 <= self.num_experts_per_tok <= self.num_experts:
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


def build_hf_config(cfg: TinyModelConfig, tokenizer):
    """The transformers config of `cfg.arch`, whose special ids match the tokenizer."""
    from transformers import LlamaConfig, MixtralConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

    common = dict(
        vocab_size=cfg.vocab_size or len(tokenizer),
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
    head_dim = cfg.hidden_size // cfg.num_heads  # Qwen3's default head_dim is 128 whatever the width
    if cfg.arch == "qwen3_moe":
        return Qwen3MoeConfig(
            head_dim=head_dim,
            num_experts=cfg.num_experts,
            num_experts_per_tok=cfg.num_experts_per_tok,
            moe_intermediate_size=cfg.moe_intermediate_size,
            norm_topk_prob=cfg.norm_topk_prob,
            **common,
        )
    if cfg.arch == "mixtral":
        return MixtralConfig(
            num_local_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok, **common
        )
    if cfg.arch == "qwen3":
        return Qwen3Config(head_dim=head_dim, **common)
    return {"qwen2": Qwen2Config, "llama": LlamaConfig}[cfg.arch](**common)


def build_model(cfg: TinyModelConfig, tokenizer):
    """A randomly initialised model of `cfg.arch`, seeded, whose special ids match the tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    torch.manual_seed(cfg.seed)
    model = AutoModelForCausalLM.from_config(build_hf_config(cfg, tokenizer))
    if cfg.init_std:
        redraw_weights(model, cfg.init_std)
    model.generation_config = GenerationConfig(
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    return model


def redraw_weights(model, std: float) -> None:
    """Every weight and bias ~ N(0, std), every norm scale ~ 1 + N(0, std / 2), from torch's RNG.

    For tests of weight layouts: with std 0.2 a tensor loaded into the wrong place shows as a
    large logit difference instead of hiding under transformers' near-zero initialisation.
    """
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + std / 2 * torch.randn_like(param))
            else:
                param.copy_(std * torch.randn_like(param))


def make_tiny_model(out_dir: str | Path, *, sharded: bool = False, **overrides) -> Path:
    """Writes the tiny model and tokenizer to `out_dir` and returns it.

    `overrides` are `TinyModelConfig` fields (arch, num_layers, hidden_size, ..., seed,
    init_std, num_experts, ...). The same arguments always give the same weights. `sharded`
    splits the safetensors into at least two files with an index, as a downloaded model's are.
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
    tokenizer.add_tokens(list(cfg.added_tokens))
    model = build_model(cfg, tokenizer)
    if sharded:
        total_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        model.save_pretrained(out, max_shard_size=max(total_bytes // 3, 1), safe_serialization=True)
        _check_sharded(out)
    else:
        model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def _check_sharded(out: Path) -> None:
    index_file = out / "model.safetensors.index.json"
    if not index_file.exists():
        raise RuntimeError(f"expected a sharded checkpoint in {out}, found no index json")
    shards = set(json.loads(index_file.read_text())["weight_map"].values())
    if len(shards) < 2:
        raise RuntimeError(f"expected at least two shards in {out}, got {sorted(shards)}")
