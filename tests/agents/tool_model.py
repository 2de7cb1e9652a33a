"""A tiny model that uses tools: the shared tiny Qwen2 (head size 32, what vLLM's CPU attention
needs) fitted in a few hundred steps to reproduce given chat transcripts, so that greedy decoding
replays their tool calls turn by turn. Nothing is downloaded; training runs in this process."""

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hybridflow.utils.tiny_model import make_tiny_model


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
