"""The tool-use demo's data: a warm-start trace is token for token what the agent loop builds
(sampled call + EOS, the tool turn as tool_response_renderer renders it, the answer)."""

import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

from hybridflow.agents.loop import ToolTurnResult, tool_response_renderer
from hybridflow.agents.tool_parser import ToolCall, parse_tool_calls
from hybridflow.data.arith import ArithConfig
from hybridflow.data.tool_arith import TOOL_TOKENS, tool_call_text, tool_trace, write_tool_arith_parquet
from hybridflow.utils.tiny_model import make_tiny_model


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    model = make_tiny_model(tmp_path_factory.mktemp("tool_arith") / "m", added_tokens=TOOL_TOKENS)
    return AutoTokenizer.from_pretrained(model)


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_a_trace_is_the_agent_loops_tokens(tokenizer):
    trace = tool_trace([{"role": "user", "content": "What is 123*456?"}], "123*456", tokenizer)
    call = [*ids(tokenizer, tool_call_text("123*456")), tokenizer.eos_token_id]
    expected = (
        call
        + tool_response_renderer(tokenizer)(ToolTurnResult(["56088"], 0, ["calculator"]), True, 0)
        + ids(tokenizer, "#### 56088")
    )
    assert ids(tokenizer, trace) == expected
    assert len(call) < 20, tokenizer.convert_ids_to_tokens(call)  # the added pieces, not 80 bytes
    (parsed,) = parse_tool_calls(tokenizer.decode(call))
    assert parsed == ToolCall("calculator", {"expression": "123*456"})


def test_a_share_of_rows_call_the_tool(tokenizer, tmp_path):
    problems = ArithConfig(num_train=400, num_test=20, min_operand=100, max_operand=999, operators=["*"])
    paths = write_tool_arith_parquet(tmp_path, tokenizer, tool_fraction=0.3, cfg=problems)
    rows = pq.read_table(paths["train"]).to_pylist()
    calls = [r for r in rows if r["extra_info"]["answer"].startswith("<tool_call>")]
    assert 0.2 < len(calls) / len(rows) < 0.4
    direct = next(r for r in rows if r not in calls)
    a, b = direct["extra_info"]["question"].removeprefix("What is ").removesuffix("?").split("*")
    assert direct["extra_info"]["answer"] == f"{a}*{b}={int(a) * int(b)}\n#### {int(a) * int(b)}"
    with pytest.raises(ValueError, match="tool_fraction must be in"):
        write_tool_arith_parquet(tmp_path, tokenizer, tool_fraction=1.5, cfg=problems)
