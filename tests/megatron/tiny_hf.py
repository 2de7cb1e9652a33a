"""Engine-test settings for the shared tiny model (`hybridflow.utils.tiny_model`), and batches
shaped like a rollout's.

`make_tiny_hf_checkpoint(out_dir, arch="qwen2")` writes the shared builder's Hugging Face
directory (same tokenizer and chat template as the quickstart's model) with the engine tests'
choices: narrower than the quickstart's model so that multi-process parity runs stay fast,
weights drawn with std 0.2, and safetensors split into shards with an index, so that tests
exercise the same loading path as a real downloaded model. Nothing is downloaded.

Import from a test with `from tiny_hf import make_tiny_hf_checkpoint` (pytest puts this folder
on sys.path; so does torchrun for worker scripts that live here).
"""

from pathlib import Path

import torch

from hybridflow.utils.tiny_model import MOE_ARCHS, SPECIAL_TOKENS, byte_vocab, make_tiny_model

ENGINE_TEST_SETTINGS = dict(
    hidden_size=64,
    intermediate_size=128,
    init_std=0.2,  # weights in the wrong place give large logit differences
    moe_intermediate_size=32,
    norm_topk_prob=False,
)
MOE_EXPERTS = 4


def make_tiny_hf_checkpoint(out_dir, arch: str = "qwen2", **overrides) -> Path:
    """Write a random fp32 checkpoint of `arch` to `out_dir` (sharded, with the tokenizer) and
    return it as a Path.

    `overrides` are `TinyModelConfig` fields (num_layers, vocab_size, seed, ...) over
    ENGINE_TEST_SETTINGS; the MoE archs get MOE_EXPERTS experts of width 32, top-2.
    """
    settings = {**ENGINE_TEST_SETTINGS, "num_experts": MOE_EXPERTS if arch in MOE_ARCHS else 0}
    return make_tiny_model(out_dir, sharded=True, **{**settings, "arch": arch, **overrides})


def ascii_vocab_size() -> int:
    """How many ids of the shared tokenizer are special tokens or printable ASCII characters (they
    come first): a model with this vocabulary emits only ids that decode to one character or one
    special token."""
    vocab = byte_vocab()
    return 1 + max(i for token, i in vocab.items() if token in SPECIAL_TOKENS or token.isascii())


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
