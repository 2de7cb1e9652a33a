"""Three-digit multiplication with a calculator: the tool-use demo's data (scripts/tool_demo.sh).

A 1M-parameter model cannot multiply 123 by 456 in its head; with the calculator it only has to
copy: the operands into a tool call, the tool's answer into GSM8K's "#### <n>" line. Rows are the
arith rows (hybridflow/data/arith.py: same prompt, reward and splits) whose `extra_info.answer`,
the supervised warm start's target, is for a share of the rows a whole tool-using trace as the
model will produce it inside the agent loop (the call, EOS, the tool turn as the chat template
renders it, the answer) and for the others the product written down directly.

TOOL_TOKENS are pieces a BPE vocabulary has (Qwen2.5 has <tool_call> and </tool_call> as single
tokens); added to the tiny model's byte vocabulary they keep a call about 15 tokens long instead
of 80 bytes, so the demo trains in minutes on CPU.
"""

import asyncio
import json
import random
from pathlib import Path

from hybridflow.agents.tool_parser import TOOL_CALL_CLOSE, TOOL_CALL_OPEN
from hybridflow.agents.tools.calculator import Calculator
from hybridflow.data.arith import ArithConfig, make_splits

TOOL_TOKENS = (
    TOOL_CALL_OPEN,
    TOOL_CALL_CLOSE,
    '{"name": ',
    '"calculator"',
    ', "arguments": ',
    '{"expression": ',
    '"}}',
    "<|tool|>",
    "####",
)
# Share of warm-start traces that call the calculator; the rest answer "in the head" (the arith
# rows' own answers), which the model cannot learn: RL has to discover that the tool pays.
TOOL_FRACTION = 0.3


def demo_problems() -> ArithConfig:
    """4,000 train / 200 held-out products of two three-digit numbers."""
    return ArithConfig(min_operand=100, max_operand=999, operators=["*"])


def tool_call_text(expression: str) -> str:
    """The Hermes / Qwen tool call of the calculator on `expression`."""
    call = {"name": Calculator.name, "arguments": {"expression": expression}}
    return f"{TOOL_CALL_OPEN}\n{json.dumps(call)}\n{TOOL_CALL_CLOSE}"


def tool_trace(prompt: list[dict], expression: str, tokenizer) -> str:
    """What follows the prompt in a trajectory that calls the calculator once, then answers: the
    call, then (rendered by the chat template, EOS included) the tool turn and the next assistant
    prompt, then "#### <result>". SFT appends the final EOS."""
    result = asyncio.run(Calculator().call({"expression": expression}))
    turns = [*prompt, {"role": "assistant", "content": tool_call_text(expression)}]
    turns.append({"role": "tool", "content": result})
    head = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    full = tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
    if not full.startswith(head):
        raise ValueError("the chat template renders the prompt differently when turns follow it")
    return f"{full[len(head) :]}#### {result}"


def write_tool_arith_parquet(
    out_dir: str | Path, tokenizer, tool_fraction: float = TOOL_FRACTION, cfg: ArithConfig | None = None
) -> dict[str, Path]:
    """train.parquet / test.parquet under `out_dir`. A `tool_fraction` of the rows (drawn with
    the problems' seed) have a tool trace as SFT answer, the others the bare "#### <product>"."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if not 0.0 <= tool_fraction <= 1.0:
        raise ValueError(f"tool_fraction must be in [0, 1], got {tool_fraction}")
    cfg = cfg or demo_problems()
    rng = random.Random(cfg.seed)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split, rows in make_splits(cfg).items():
        for row in rows:
            expression = row["extra_info"]["question"].removeprefix("What is ").removesuffix("?")
            if rng.random() < tool_fraction:
                row["extra_info"]["answer"] = tool_trace(row["prompt"], expression, tokenizer)
        paths[split] = out / f"{split}.parquet"
        pq.write_table(pa.Table.from_pylist(rows), paths[split])
    return paths
