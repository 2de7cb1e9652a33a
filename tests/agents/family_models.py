"""A tiny model per tool-call family, for training a two-turn tool episode on each family's chat
template (test_family_tool_recipes.py): one shared tiny Qwen2 (2 layers: fitted in about 140 steps)
fitted until greedy decoding replays, after each family's prompt, the family's own call of the
calculator and, after the tool response the template appends, its answer `#### 408`; each family's
directory holds those weights with the family's tokenizer (template_families.py's template and end
tokens) and EOS.

The tokenizers share one vocabulary (the one-token-per-byte vocabulary and every family's special
tokens, in one order), so one model serves every family; nothing is downloaded.
"""

from pathlib import Path

import torch
from template_families import FAMILIES
from tool_call_templates import QWEN3_CODER_FAMILY
from tool_model import fit_transcripts

from hybridflow.agents.template import (
    call_id,
    end_of_turn_ids,
    message_delta_renderer,
    template_end_of_turn,
    tool_messages,
)
from hybridflow.agents.tools.base import tool_schemas
from hybridflow.agents.tools.calculator import Calculator
from hybridflow.utils.tiny_model import TinyModelConfig, build_model

# one family per tool-call format
RUN_FAMILIES = [
    *(f for f in FAMILIES if f.name in ("qwen2.5", "llama3.1", "mistral-v0.3", "deepseek-v3", "gpt-oss")),
    QWEN3_CODER_FAMILY,
]
QUESTION = [{"role": "user", "content": "What is 12*34?"}]
EXPRESSION, RESULT, FINAL = "12*34", "408", "#### 408"
SCHEMAS = tool_schemas([Calculator()])
CALL_TURN = {
    "role": "assistant",
    "content": "",
    "tool_calls": [
        {
            "id": call_id(0, 0),
            "type": "function",
            "function": {"name": "calculator", "arguments": {"expression": EXPRESSION}},
        }
    ],
}
ANSWERS = tool_messages(["calculator"], [RESULT], turn=0)


def shared_tokenizer(family):
    """The family's tokenizer over the shared vocabulary: `family.tokenizer()` of a family that
    holds every family's special tokens, with this family's template, EOS and BOS."""
    specials = list(dict.fromkeys(t for f in RUN_FAMILIES for t in [*f.special_tokens, f.eos, f.bos]))
    union = type(family)("all", family.template, specials, "<|im_end|>", "<|im_end|>").tokenizer()
    union.eos_token, union.bos_token = family.eos, family.bos
    return union


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def episode(tokenizer) -> dict[str, list[int]]:
    """The ids of the episode the model learns on `tokenizer`'s template: `prompt`, the sampled
    `call` turn, the tool response `appended` as the tool loop renders it, the sampled `final` turn."""

    def render(messages, generation_prompt=True):
        return tokenizer.apply_chat_template(
            messages, tools=SCHEMAS, tokenize=False, add_generation_prompt=generation_prompt
        )

    ends = end_of_turn_ids(tokenizer, [tokenizer.eos_token_id])
    prompt, after_call = render(QUESTION), render([*QUESTION, CALL_TURN, *ANSWERS])
    call = ids(tokenizer, after_call[len(prompt) :])
    call = call[: next(i for i, t in enumerate(call) if t in ends) + 1]  # through the call's end
    appended = message_delta_renderer(tokenizer)(ANSWERS, tools=SCHEMAS, closed=True)
    whole = render([*QUESTION, CALL_TURN, *ANSWERS, {"role": "assistant", "content": FINAL}], False)
    end_text, end_id = template_end_of_turn(tokenizer)
    final_text = whole[len(after_call) : whole.index(end_text, len(after_call))]
    # gpt-oss's answers end on its EOS (<|return|>); the template writes <|end|> in their place
    final = [*ids(tokenizer, final_text), end_id if end_id in ends else tokenizer.eos_token_id]
    return {"prompt": ids(tokenizer, prompt), "call": call, "appended": appended, "final": final}


def make_family_models(root: Path) -> dict[str, Path]:
    """A model directory per family of RUN_FAMILIES (by name), the weights shared."""
    fitted = root / "fitted"
    shared = shared_tokenizer(RUN_FAMILIES[0])
    build_model(TinyModelConfig(seed=1, num_layers=2, max_position_embeddings=1024), shared).save_pretrained(
        fitted, safe_serialization=True
    )
    shared.save_pretrained(fitted)
    episodes = [episode(shared_tokenizer(f)) for f in RUN_FAMILIES]
    rows = [e["prompt"] + e["call"] + e["appended"] + e["final"] for e in episodes]
    width = max(map(len, rows))
    targets = torch.zeros(len(rows), width, dtype=torch.bool)  # (B, T): the sampled turns
    for row, e in enumerate(episodes):
        call_at, final_at = len(e["prompt"]), len(rows[row]) - len(e["final"])
        targets[row, call_at : call_at + len(e["call"])] = True
        targets[row, final_at : len(rows[row])] = True
    if shared.padding_side == "left":
        targets = torch.stack([t.roll(width - len(r)) for t, r in zip(targets, rows, strict=True)])
    fit_transcripts(fitted, [shared.decode(r) for r in rows], targets, max_steps=600)
    return {f.name: family_dir(fitted, root / f.name, shared_tokenizer(f)) for f in RUN_FAMILIES}


def family_dir(fitted: Path, out: Path, tokenizer) -> Path:
    """The fitted weights with the family's tokenizer and generation config (its EOS)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(fitted, dtype=torch.float32)
    model.config.eos_token_id = model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.config.bos_token_id = model.generation_config.bos_token_id = tokenizer.bos_token_id
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out
