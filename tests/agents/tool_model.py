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


def make_tool_model(out_dir: Path, transcripts: list[str], steps: int = 300, lr: float = 3e-3) -> Path:
    """The tiny model at `out_dir`, trained until greedy decoding reproduces `transcripts`."""
    model_dir = make_tiny_model(out_dir, seed=1)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    batch = tokenizer(transcripts, padding=True, return_tensors="pt", add_special_tokens=False)
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)  # (B, T)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    torch.manual_seed(0)
    for _ in range(steps):
        loss = model(**batch, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.save_pretrained(model_dir)
    return model_dir
