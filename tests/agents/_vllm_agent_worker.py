"""Worker for test_agent_vllm.py: the tool agent loop on the real vLLM engine (CPU build), in a
process of its own (vLLM changes process-wide torch state).

    python tests/agents/_vllm_agent_worker.py MODEL_DIR

MODEL_DIR is the tiny model fitted to tool_model.py's conversations: one 3-turn calculator
conversation and eight turns with malformed tool calls. `build_agent_rollout` runs greedy
trajectories for their prompts, and each check prints "OK <check>":
  three-turns        the first trajectory has 3 sampled turns, 2 calculator calls, and a last turn
                     that calls no tool and starts the answer;
  ids-are-replayed   its ids, replayed independently, are exactly: each sampled run = vLLM's own
                     greedy continuation of everything before it, each tool run = the tool
                     responses rendered by the chat template; response_mask is 0 exactly on the
                     tool runs; log-probs and versions exist on sampled ids only;
  malformed-calls    each of the eight malformed calls became a tool-error turn (no exception);
  prefix-cache       (KV blocks of 32 tokens) the first trajectory's `prefill_tokens` are its three
                     turns' prompt lengths, its `prefix_cached_tokens` whole blocks, at least the
                     blocks of each turn's previous prompt and at most each turn's prompt less its
                     last token; a batch call of the prompts, made twice after the cache is
                     flushed, finds every whole block of each prompt less its last token the
                     second time (vLLM recomputes the last token: its logits are needed).
"""

import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tool_model import conversations, tool_text

from engines.rollout.config import AgentConfig, RolloutConfig, SamplingConfig
from engines.rollout.vllm_rollout import VLLMRolloutEngine
from hybridflow.agents.rollout import build_agent_rollout
from hybridflow.protocol import DataProto

CALCULATOR = "hybridflow.agents.tools.calculator.Calculator"
RESPONSE_LENGTH = 200
BLOCK = 32  # tokens per KV block: the CPU attention's smallest (vLLM's CPU default is 128)


def prompt_batch(tokenizer, conversations: list[list[dict]]) -> DataProto:
    rows = [
        tokenizer.apply_chat_template(c[:1], add_generation_prompt=True)["input_ids"] for c in conversations
    ]
    width = max(map(len, rows))
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    return DataProto.from_dict(
        {"input_ids": ids, "attention_mask": mask, "position_ids": positions}, meta_info={"validate": True}
    )


def runs(mask: list[int]) -> list[tuple[int, int, int]]:
    """(start, end, value) of each run of equal values in `mask`."""
    bounds = [0] + [i for i in range(1, len(mask)) if mask[i] != mask[i - 1]] + [len(mask)]
    return [(a, b, mask[a]) for a, b in itertools.pairwise(bounds)]


def check_replay(engine: VLLMRolloutEngine, tokenizer, out: DataProto) -> None:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from hybridflow.agents.template import message_delta_renderer

    render = message_delta_renderer(tokenizer)
    length = int(out.batch["attention_mask"][0, out.batch["prompts"].shape[1] :].sum())
    ids = out.batch["responses"][0, :length].tolist()
    mask = out.batch["response_mask"][0, :length].tolist()
    prompt = out.batch["prompts"][0][out.batch["prompts"][0] != 0].tolist()
    for start, end, sampled in runs(mask):
        if sampled:
            greedy = SamplingParams(
                max_tokens=end - start, temperature=0.0, stop_token_ids=engine.eos_token_ids
            )
            replay = engine.llm.generate([TokensPrompt(prompt_token_ids=prompt + ids[:start])], greedy)
            assert list(replay[0].outputs[0].token_ids) == ids[start:end], (start, end)
        else:
            turn = tokenizer.decode(prompt + ids[:start])
            last_turn = turn[turn.rindex("<|assistant|>") + len("<|assistant|>") :]
            assert ids[start:end] == render([{"role": "tool", "content": tool_text(last_turn)}]), (start, end)
    log_probs = out.batch["rollout_log_probs"][0, :length]
    versions = out.batch["rollout_versions"][0, :length]
    tool = torch.tensor(mask) == 0
    assert bool((log_probs[tool] == 0).all()) and bool((versions[tool] == -1).all())
    assert bool((versions[~tool] == 0).all()) and bool((log_probs[~tool] < 0).all())
    print("OK ids-are-replayed", flush=True)


def main(model_dir: Path) -> None:
    from transformers import AutoTokenizer

    chats = conversations()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    greedy = SamplingConfig(do_sample=False, temperature=0.0)
    agent = AgentConfig(loop="tool", tools=[CALCULATOR], max_turns=4)
    cfg = RolloutConfig(
        name="vllm",
        load_format="auto",
        response_length=RESPONSE_LENGTH,
        val_sampling=greedy,
        agent=agent,
        vllm={"block_size": BLOCK},
    )
    engine = VLLMRolloutEngine(model_dir, cfg)
    out = build_agent_rollout(engine, cfg, str(model_dir)).generate_sequences(prompt_batch(tokenizer, chats))
    metrics = {
        key: out.non_tensor_batch[f"agent_{key}"].tolist() for key in ("turns", "tool_calls", "tool_errors")
    }
    answer = tokenizer.decode(out.batch["responses"][0][out.batch["response_mask"][0].bool()].tolist())
    assert (metrics["turns"][0], metrics["tool_calls"][0], metrics["tool_errors"][0]) == (3, 2, 0), metrics
    assert answer.count("<tool_call>") == 2 and "####" in answer.rsplit("</tool_call>", 1)[1], answer
    print("OK three-turns", flush=True)
    check_replay(engine, tokenizer, out)
    assert all(errors >= 1 for errors in metrics["tool_errors"][1:]), metrics
    for row in range(1, len(chats)):
        text = tokenizer.decode(out.batch["responses"][row][out.batch["response_mask"][row] == 0].tolist())
        assert "<|tool|>Error: " in text, (row, text)
    print("OK malformed-calls", flush=True)
    check_prefix_cache(engine, tokenizer, out, prompt_batch(tokenizer, chats))
    engine.shutdown()


def whole_blocks(tokens: int) -> int:
    return tokens // BLOCK * BLOCK


def check_prefix_cache(engine: VLLMRolloutEngine, tokenizer, out: DataProto, prompts: DataProto) -> None:
    width = out.batch["prompts"].shape[1]
    length = int(out.batch["attention_mask"][0, width:].sum())
    prompt = int(out.batch["attention_mask"][0, :width].sum())
    sampled_runs = runs(out.batch["response_mask"][0, :length].tolist())
    turns = [prompt + start for start, _, sampled in sampled_runs if sampled]
    assert len(turns) == 3, turns  # each turn's prompt length
    assert int(out.batch["prefill_tokens"][0]) == sum(turns), (out.batch["prefill_tokens"][0], turns)
    cached = int(out.batch["prefix_cached_tokens"][0])
    least = sum(whole_blocks(before) for before in turns[:-1])
    most = sum(whole_blocks(turn - 1) for turn in turns)
    assert cached % BLOCK == 0 and 0 < least <= cached <= most, (cached, least, most, turns)
    engine.flush_cache()
    engine.generate_sequences(prompts)
    again = engine.generate_sequences(prompts)
    lengths = prompts.batch["attention_mask"].sum(dim=1)  # (B,)
    assert again.batch["prefill_tokens"].tolist() == lengths.tolist()
    assert again.batch["prefix_cached_tokens"].tolist() == [whole_blocks(n - 1) for n in lengths.tolist()]
    print("OK prefix-cache", flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
