"""What the OpenAI-endpoint tests share: a scripted engine (`ScriptedChat`), the calculator question
and call text, a batch of agent prompts and an `OpenAIAgentRollout` over a given engine."""

import torch

from engines.rollout.config import AgentConfig, RolloutConfig, SamplingConfig
from engines.rollout.requests import Completion
from hybridflow.agents.openai_loop import OpenAIAgentRollout, engine_requests
from hybridflow.data.prompt_dataset import tokenize_chat
from hybridflow.protocol import DataProto

QUESTION = [{"role": "user", "content": "What is 12*34+1?"}]
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "%s"}}\n</tool_call>'


class ScriptedChat:
    """Answers request k with the text script[k] (+ EOS unless `cut`), char-level ids."""

    def __init__(self, tokenizer, script: list[str], cut: tuple[int, ...] = ()):
        self.tokenizer, self.script, self.cut, self.requests = tokenizer, script, cut, []

    def ids(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    async def generate(self, ids, request_or_sampling, seed: int, max_new_tokens: int) -> Completion:
        k = len(self.requests)
        self.requests.append((list(ids), request_or_sampling, seed, max_new_tokens))
        eos = [] if k in self.cut else [self.tokenizer.eos_token_id]
        tokens = (self.ids(self.script[k]) + eos)[:max_new_tokens]
        finish = "length" if k in self.cut or (len(tokens) == max_new_tokens and not eos) else "stop"
        return Completion(tokens, [-0.25] * len(tokens), [3] * len(tokens), finish)


def agent_prompts(tokenizer, rows: int) -> DataProto:
    ids = torch.tensor([tokenize_chat(tokenizer, QUESTION, None)] * rows)
    mask = torch.ones_like(ids)
    return DataProto.from_dict(
        {"input_ids": ids, "attention_mask": mask, "position_ids": mask.cumsum(-1) - 1},
        {"raw_prompt": [QUESTION] * rows, "data_source": ["arith"] * rows},
        meta_info={"validate": True},
    )


def openai_rollout(agent, engine, tokenizer) -> OpenAIAgentRollout:
    greedy = SamplingConfig(do_sample=False, temperature=0.0)
    agent_cfg = AgentConfig(loop="openai", openai_agent="tests:unused")
    cfg = RolloutConfig(name="vllm", response_length=300, val_sampling=greedy, agent=agent_cfg)
    eos = [tokenizer.eos_token_id]
    return OpenAIAgentRollout(agent, engine_requests(engine), tokenizer, cfg, tokenizer.pad_token_id, eos)
