"""Worker for test_openai_vllm.py: agents written against the `openai` client, run by
`rollout.agent.loop=openai` through the chat-completions endpoint on the real vLLM engine (CPU
build), in a process of its own (vLLM changes process-wide torch state).

    python tests/agents/_vllm_openai_worker.py MODEL_DIR

MODEL_DIR is the tiny model fitted to tool_model.py's 3-turn calculator conversation. One greedy
call runs two rows (`_openai_agents.py`) and each check prints "OK <check>":
  three-turns        row 0 (the example calculator agent): 3 sampled turns, 2 tool calls, an
                     answer with "####", no divergence, and the data set's prompt ids as its prompt;
  token-in-token-out its response ids are exactly, run by run, the ids the engine returned for a
                     request whose prompt was everything before them (with the engine's log-probs
                     and versions), and the tool responses rendered as a delta of the chat
                     template; response_mask is 0 exactly on the latter, log-probs only on the former;
  refused-and-edited row 1: n=2 was refused with a 400 naming `n`, and resending an edited history
                     started a new segment: one divergence, trained on the last segment, whose
                     prompt is the edited conversation rendered from scratch.
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _vllm_agent_worker import runs
from tool_model import QUESTION

from engines.rollout.config import AgentConfig, RolloutConfig, SamplingConfig
from engines.rollout.vllm_rollout import VLLMRolloutEngine
from hybridflow.agents.rollout import build_agent_rollout
from hybridflow.agents.template import message_delta_renderer
from hybridflow.data.prompt_dataset import tokenize_chat
from hybridflow.protocol import DataProto

RESPONSE_LENGTH = 200
MESSAGES = [{"role": "user", "content": QUESTION}]


def prompt_batch(tokenizer, agents: list[str]) -> DataProto:
    ids = torch.tensor([tokenize_chat(tokenizer, MESSAGES)] * len(agents))
    mask = torch.ones_like(ids)
    fields = {"raw_prompt": [MESSAGES] * len(agents), "extra_info": [{"agent": a} for a in agents]}
    return DataProto.from_dict(
        {"input_ids": ids, "attention_mask": mask, "position_ids": mask.cumsum(-1) - 1},
        fields,
        meta_info={"validate": True},
    )


def record_requests(rollout) -> list:
    """Every (prompt ids, completion) the request engine returned, in order."""
    seen, request = [], rollout.request

    async def recorded(session, ids, sampling, seed, max_new_tokens):
        completion = await request(session, ids, sampling, seed, max_new_tokens)
        seen.append((list(ids), completion))
        return completion

    rollout.request = recorded
    return seen


def row(out: DataProto, index: int) -> tuple[list[int], list[int], list[int], torch.Tensor, torch.Tensor]:
    width = out.batch["prompts"].shape[1]
    prompt_mask = out.batch["attention_mask"][index, :width].bool()
    length = int(out.batch["attention_mask"][index, width:].sum())
    prompt = out.batch["prompts"][index][prompt_mask].tolist()
    ids = out.batch["responses"][index, :length].tolist()
    mask = out.batch["response_mask"][index, :length].tolist()
    log_probs = out.batch["rollout_log_probs"][index, :length]
    versions = out.batch["rollout_versions"][index, :length]
    return prompt, ids, mask, log_probs, versions


def check_three_turns(tokenizer, out: DataProto) -> None:
    metrics = {k: out.non_tensor_batch[f"agent_{k}"][0] for k in ("turns", "tool_calls", "divergences")}
    assert (metrics["turns"], metrics["tool_calls"], metrics["divergences"]) == (3, 2, 0), metrics
    prompt, ids, mask, _, _ = row(out, 0)
    answer = tokenizer.decode([i for i, m in zip(ids, mask, strict=True) if m])
    assert answer.count("<tool_call>") == 2 and "####" in answer.rsplit("</tool_call>", 1)[1], answer
    assert prompt == tokenize_chat(tokenizer, MESSAGES), prompt
    print("OK three-turns", flush=True)


def check_token_in_token_out(tokenizer, out: DataProto, requests: list) -> None:
    prompt, ids, mask, log_probs, versions = row(out, 0)
    render = message_delta_renderer(tokenizer)
    tool_texts = iter(["408", "409"])  # what the calculator answers to the memorised calls
    for start, end, sampled in runs(mask):
        if sampled:
            asked = [c for r, c in requests if r == prompt + ids[:start]]  # row 1 asks the first one too
            completion = next((c for c in asked if c.token_ids == ids[start:end]), None)
            assert completion is not None, (start, end, [c.token_ids for c in asked])
            assert log_probs[start:end].tolist() == torch.tensor(completion.log_probs).tolist()
            assert versions[start:end].tolist() == completion.versions
        else:
            assert ids[start:end] == render([{"role": "tool", "content": next(tool_texts)}]), (start, end)
    tool = torch.tensor(mask) == 0
    assert bool((log_probs[tool] == 0).all()) and bool((versions[tool] == -1).all())
    assert bool((log_probs[~tool] < 0).all()) and int(tool.sum()) > 0
    print("OK token-in-token-out", flush=True)


def check_refused_and_edited(tokenizer, out: DataProto, requests: list) -> None:
    assert out.non_tensor_batch["agent_divergences"][1] == 1, out.non_tensor_batch["agent_divergences"]
    prompt, ids, mask, _, _ = row(out, 1)
    last_request, completion = next(
        (r, c) for r, c in requests if tokenizer.decode(r).startswith("<|system|>")
    )
    assert prompt == last_request and ids == completion.token_ids and set(mask) == {1}
    assert tokenizer.decode(prompt).startswith("<|system|>Be brief.<|user|>" + QUESTION), tokenizer.decode(
        prompt
    )
    print("OK refused-and-edited", flush=True)


def main(model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    greedy = SamplingConfig(do_sample=False, temperature=0.0)
    agent = AgentConfig(loop="openai", openai_agent="_openai_agents:run")
    cfg = RolloutConfig(
        name="vllm", load_format="auto", response_length=RESPONSE_LENGTH, val_sampling=greedy, agent=agent
    )
    engine = VLLMRolloutEngine(model_dir, cfg)
    rollout = build_agent_rollout(engine, cfg, str(model_dir))
    requests = record_requests(rollout)
    out = rollout.generate_sequences(prompt_batch(tokenizer, ["calculator", "edit"]))
    check_three_turns(tokenizer, out)
    check_token_in_token_out(tokenizer, out, requests)
    check_refused_and_edited(tokenizer, out, requests)
    engine.shutdown()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
