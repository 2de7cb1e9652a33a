"""A tiny model that uses tools: the shared tiny Qwen2 (head size 32, what vLLM's CPU attention
needs) fitted in a few hundred steps to reproduce chat transcripts, so that greedy decoding
replays their tool calls turn by turn: one 3-turn calculator conversation ("What is 12*34+1?",
answer 409) and eight turns with malformed tool calls ("Case k"). Nothing is downloaded;
training runs in this process."""

import asyncio
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hybridflow.agents.tool_parser import parse_tool_calls, run_tool_calls
from hybridflow.agents.tools.calculator import Calculator
from hybridflow.utils.tiny_model import build_tokenizer, make_tiny_model

CALL = '<tool_call>\n{"name": "calculator", "arguments": %s}\n</tool_call>'
QUESTION, ANSWER = "What is 12*34+1?", "409"
CHECK_EVERY, MARGIN = 10, 1.0  # memorisation check: steps between, nats of margin
MALFORMED = [
    '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1+"}\n</tool_call>',  # bad JSON
    '<tool_call>\n{"arguments": {"expression": "1+1"}}\n</tool_call>',  # no name
    CALL % '"2*3"',  # arguments not an object
    '<tool_call>\n{"name": "search", "arguments": {"q": "x"}}\n</tool_call>',  # unknown tool
    CALL % '{"expression": 7}',  # wrong argument type
    CALL % "{}",  # missing required argument
    CALL % '{"expression": "9**99999"}',  # the tool refuses it
    '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1"}}',  # unclosed tag
]


def tool_text(call_text: str) -> str:
    """What the calculator answers to the call in `call_text` (an error text for a bad call)."""
    return asyncio.run(run_tool_calls(parse_tool_calls(call_text), [Calculator()], 10.0))[0].text


def conversations() -> list[list[dict]]:
    """The conversations the model learns: the 3-turn one first, then the malformed calls."""
    first, second = CALL % '{"expression": "12*34"}', CALL % '{"expression": "408+1"}'
    three_turns = [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": first},
        {"role": "tool", "content": tool_text(first)},
        {"role": "assistant", "content": second},
        {"role": "tool", "content": tool_text(second)},
        {"role": "assistant", "content": f"#### {ANSWER}"},
    ]
    malformed = [
        [{"role": "user", "content": f"Case {k}"}, {"role": "assistant", "content": bad}]
        for k, bad in enumerate(MALFORMED)
    ]
    return [three_turns, *malformed]


def make_tool_using_model(out_dir: Path) -> Path:
    tokenizer = build_tokenizer()
    texts = [tokenizer.apply_chat_template(c, tokenize=False) for c in conversations()]
    return make_tool_model(out_dir, texts)


def make_tool_model(out_dir: Path, transcripts: list[str], max_steps: int = 400, lr: float = 3e-3) -> Path:
    """The tiny model at `out_dir`, trained until greedy decoding reproduces every assistant turn
    of `transcripts` with a margin (checked every CHECK_EVERY steps; an error after max_steps)."""
    model_dir = make_tiny_model(out_dir, seed=1)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    batch = tokenizer(transcripts, padding=True, return_tensors="pt", add_special_tokens=False)
    targets = assistant_token_mask(batch["input_ids"], tokenizer)  # (B, T)
    return fit_transcripts(model_dir, transcripts, targets, max_steps, lr)


def fit_transcripts(
    model_dir: Path, transcripts: list[str], targets: torch.Tensor, max_steps: int = 400, lr: float = 3e-3
) -> Path:
    """The model at `model_dir` trained on `transcripts` until greedy decoding reproduces each
    token where `targets` (B, T) is True with a margin; saved there."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    batch = tokenizer(transcripts, padding=True, return_tensors="pt", add_special_tokens=False)
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)  # (B, T)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    torch.manual_seed(0)
    for step in range(max_steps + 1):
        out = model(**batch, labels=labels)
        if step % CHECK_EVERY == 0 and greedy_reproduces(out.logits, batch["input_ids"], targets):
            model.save_pretrained(model_dir)
            return model_dir
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    raise RuntimeError(f"the tool model did not memorise its transcripts in {max_steps} steps")


def assistant_token_mask(input_ids: torch.Tensor, tokenizer) -> torch.Tensor:
    """True (B, T) on the tokens of assistant turns: after `<|assistant|>`, up to its EOS included."""
    start, end = tokenizer.convert_tokens_to_ids("<|assistant|>"), tokenizer.eos_token_id
    mask = torch.zeros_like(input_ids, dtype=torch.bool)
    for row, ids in enumerate(input_ids.tolist()):
        inside = False
        for t, token in enumerate(ids):
            mask[row, t] = inside
            inside = token == start or (inside and token != end)
    return mask


def greedy_reproduces(logits: torch.Tensor, input_ids: torch.Tensor, targets: torch.Tensor) -> bool:
    """Every target token is the argmax after its prefix, by at least MARGIN nats over the next
    best, so greedy decoding in another engine (vLLM) replays it despite rounding differences."""
    top2 = logits[:, :-1].log_softmax(-1).topk(2, dim=-1)  # values/indices (B, T-1, 2)
    right = top2.indices[..., 0] == input_ids[:, 1:]
    clear = top2.values[..., 0] - top2.values[..., 1] >= MARGIN
    return bool(((right & clear) | ~targets[:, 1:]).all())
