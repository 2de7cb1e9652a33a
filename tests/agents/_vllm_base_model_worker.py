"""Worker for test_agent_end_of_turn.py: the tool agent loop on the real vLLM engine (CPU build)
with a base model that writes past its end of turn (base_model.py), in a process of its own
(vLLM changes process-wide torch state).

    python tests/agents/_vllm_base_model_worker.py MODEL_DIR

One greedy trajectory of two turns at most; each check prints "OK <check>":
  stops-at-end-of-turn  the first sampled turn is exactly the call and its `<|im_end|>`; no
                        sampled run holds an end-of-turn id anywhere but at its end, so nothing
                        the model wrote after its end of turn has response_mask 1;
  only-real-calls-run   the first tool run is the calculator's real answer (408) to the one call
                        made before the end of turn, as the chat template renders it: the call
                        the model invented after its end of turn (7*7) was not executed.
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _vllm_agent_worker import runs
from base_model import FIRST_TURN, prompt_text

from engines.rollout.config import AgentConfig, RolloutConfig, SamplingConfig
from engines.rollout.vllm_rollout import VLLMRolloutEngine
from hybridflow.agents.rollout import build_agent_rollout
from hybridflow.agents.template import end_of_turn_ids, message_delta_renderer, tool_messages
from hybridflow.agents.tools.base import load_tool, tool_schemas
from hybridflow.protocol import DataProto

CALCULATOR = "hybridflow.agents.tools.calculator.Calculator"


def prompt_batch(prompt: list[int]) -> DataProto:
    ids = torch.tensor([prompt])
    mask = torch.ones_like(ids)
    return DataProto.from_dict(
        {"input_ids": ids, "attention_mask": mask, "position_ids": mask.cumsum(-1) - 1},
        meta_info={"validate": True},
    )


def main(model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    greedy = SamplingConfig(do_sample=False, temperature=0.0)
    agent = AgentConfig(loop="tool", tools=[CALCULATOR], max_turns=2)
    cfg = RolloutConfig(
        name="vllm", load_format="auto", response_length=160, val_sampling=greedy, agent=agent
    )
    engine = VLLMRolloutEngine(model_dir, cfg)
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") not in engine.eos_token_ids, engine.eos_token_ids
    prompt = tokenizer(prompt_text(tokenizer), add_special_tokens=False)["input_ids"]
    out = build_agent_rollout(engine, cfg, str(model_dir)).generate_sequences(prompt_batch(prompt))
    length = int(out.batch["attention_mask"][0, len(prompt) :].sum())
    ids = out.batch["responses"][0, :length].tolist()
    mask = out.batch["response_mask"][0, :length].tolist()
    pieces = [(tokenizer.decode(ids[a:b]), sampled) for a, b, sampled in runs(mask)]
    print("trajectory (text, sampled):", pieces, flush=True)
    ends = end_of_turn_ids(tokenizer, engine.eos_token_ids)
    first, *_ = runs(mask)
    assert ids[first[0] : first[1]] == tokenizer(FIRST_TURN, add_special_tokens=False)["input_ids"], pieces
    for start, end, sampled in runs(mask):
        inside = [t for t in ids[start : end - 1] if t in ends] if sampled else []
        assert not inside, f"sampled ids after an end of turn (mask 1): {tokenizer.decode(ids[start:end])!r}"
    print("OK stops-at-end-of-turn", flush=True)
    _, tool_run, *_ = runs(mask)
    render = message_delta_renderer(tokenizer)
    schemas = tool_schemas([load_tool(CALCULATOR)])
    expected = render(tool_messages(["calculator"], ["408"], turn=0), tools=schemas, closed=True)
    assert tool_run[2] == 0 and ids[tool_run[0] : tool_run[1]] == expected, pieces
    print("OK only-real-calls-run", flush=True)
    engine.shutdown()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
