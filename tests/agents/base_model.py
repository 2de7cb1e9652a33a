"""A tiny base model that invents the next turns: the shared tiny Qwen2 with the Qwen2.5 *base*
tokenizer of template_families.py (its EOS `<|endoftext|>`, which the chat template never writes;
assistant turns end on `<|im_end|>`), fitted until greedy decoding replays one transcript where,
after calling the calculator and closing its turn, the model goes on: it writes the tool's
response itself (a wrong one, 999), then another assistant turn with another call, and only then
its EOS. A base or RL-zero checkpoint does exactly this when nothing stops it at the end of its turn.
"""

from pathlib import Path

import torch
from template_families import FAMILIES
from tool_model import fit_transcripts

from hybridflow.utils.tiny_model import TinyModelConfig, build_model

CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "%s"}}\n</tool_call>'
QUESTION = [{"role": "user", "content": "What is 12*34?"}]
FIRST_TURN = CALL % "12*34" + "<|im_end|>"  # what the model should sample, up to its end of turn
INVENTED = (  # what it goes on to write after its end of turn, up to its EOS
    "\n<|im_start|>user\n<tool_response>\n999\n</tool_response><|im_end|>\n"
    "<|im_start|>assistant\n" + CALL % "7*7" + "<|im_end|><|endoftext|>"
)


def base_tokenizer():
    return next(f for f in FAMILIES if f.name == "qwen2.5-base").tokenizer()


def prompt_text(tokenizer) -> str:
    return tokenizer.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True)


def make_base_model(out_dir: Path) -> Path:
    """The fitted model and its tokenizer at `out_dir` (generation_config EOS: `<|endoftext|>`)."""
    tokenizer = base_tokenizer()
    out_dir.mkdir(parents=True, exist_ok=True)
    build_model(TinyModelConfig(seed=1), tokenizer).save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    prompt = prompt_text(tokenizer)
    transcript = prompt + FIRST_TURN + INVENTED
    ids = tokenizer(transcript, add_special_tokens=False, return_tensors="pt")["input_ids"]  # (1, T)
    targets = torch.zeros_like(ids, dtype=torch.bool)  # (1, T): every token after the prompt
    targets[:, len(tokenizer(prompt, add_special_tokens=False)["input_ids"]) :] = True
    return fit_transcripts(out_dir, [transcript], targets)
