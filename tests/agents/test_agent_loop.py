"""Agent loops over a scripted engine: trajectories are exactly the sampled ids plus the rendered
tool-response ids, masks and per-token records follow, budgets and turn limits end them; and the
rollout batch they become."""

import asyncio

import torch

from engines.rollout.requests import Completion
from hybridflow.agents.batch import trajectories_to_batch
from hybridflow.agents.loop import (
    TOOL_VERSION,
    SingleTurnLoop,
    ToolAgentLoop,
    ToolTurnResult,
    tool_response_renderer,
)
from hybridflow.protocol import DataProto
from hybridflow.utils.tiny_model import build_tokenizer

EOS = 1


class ScriptedEngine:
    """Answers turn k with script[k]; records every request it was given. Its prefix cache serves
    whole blocks of 4 tokens of each request (as if every one were cached)."""

    def __init__(self, script: list[list[int]], finish: str = "stop"):
        self.script, self.finish, self.requests = script, finish, []

    async def generate(self, ids: list[int], seed: int, max_new_tokens: int) -> Completion:
        self.requests.append((list(ids), seed, max_new_tokens))
        tokens = self.script[len(self.requests) - 1][:max_new_tokens]
        n = len(tokens)
        finish = self.finish if n < max_new_tokens or tokens[-1] == EOS else "length"
        cached = len(ids) // 4 * 4
        return Completion(tokens, [-0.5 - i for i in range(n)], [7] * n, finish, len(ids), cached)


def tool_loop(engine: ScriptedEngine, budget: int = 64, max_turns: int = 4, calls_in=(0, 1)) -> ToolAgentLoop:
    async def run_tools(text: str):
        turn = len(engine.requests) - 1
        return ToolTurnResult([f"r{turn}"], errors=turn, names=["t"]) if turn in calls_in else None

    return ToolAgentLoop(
        engine.generate,
        run_tools,
        decode=lambda ids: str(ids),
        render_tool_responses=lambda result, closed, turn: [90 + len(result.responses[0])] * 3,
        budget=budget,
        max_turns=max_turns,
        end_of_turn_ids=frozenset({EOS}),
    )


def test_three_turns_are_the_sampled_ids_plus_the_tool_ids():
    engine = ScriptedEngine([[10, 11, EOS], [20, EOS], [30, 31, 32, EOS]])
    trajectory = asyncio.run(tool_loop(engine).run([5, 6], seed=3))
    tool = [92, 92, 92]
    assert trajectory.response_ids == [10, 11, EOS, *tool, 20, EOS, *tool, 30, 31, 32, EOS]
    assert trajectory.response_mask == [1, 1, 1, 0, 0, 0, 1, 1, 0, 0, 0, 1, 1, 1, 1]
    assert trajectory.log_probs == [-0.5, -1.5, -2.5, 0, 0, 0, -0.5, -1.5, 0, 0, 0, -0.5, -1.5, -2.5, -3.5]
    assert trajectory.versions == [7, 7, 7, *[TOOL_VERSION] * 3, 7, 7, *[TOOL_VERSION] * 3, 7, 7, 7, 7]
    assert (trajectory.turns, trajectory.tool_calls, trajectory.tool_errors, trajectory.tool_tokens) == (
        3,
        2,
        1,
        6,
    )
    # each turn continues from exactly the ids so far: nothing re-tokenized, budget shrinking
    assert [request[0] for request in engine.requests] == [
        [5, 6],
        [5, 6, 10, 11, EOS, *tool],
        [5, 6, 10, 11, EOS, *tool, 20, EOS, *tool],
    ]
    assert [request[2] for request in engine.requests] == [64, 58, 53]
    assert len({request[1] for request in engine.requests}) == 3  # a seed of its own per turn


def test_budget_and_turn_limits_end_a_trajectory():
    cut = asyncio.run(tool_loop(ScriptedEngine([[10, 11, 12, 13, 14]]), budget=4).run([5], seed=0))
    assert cut.response_ids == [10, 11, 12, 13] and cut.turns == 1  # stopped by length: no tool call run
    no_room = asyncio.run(tool_loop(ScriptedEngine([[10, 11, EOS]]), budget=6).run([5], seed=0))
    assert no_room.response_ids == [10, 11, EOS] and no_room.tool_calls == 1  # 3 + 3 tool ids fill it
    one_turn = asyncio.run(tool_loop(ScriptedEngine([[10, EOS], [20, EOS]]), max_turns=1).run([5], seed=0))
    assert one_turn.response_ids == [10, EOS] and one_turn.tool_calls == 0
    single = asyncio.run(SingleTurnLoop(ScriptedEngine([[10, EOS]]).generate, budget=8).run([5], seed=0))
    assert single.response_ids == [10, EOS] and single.response_mask == [1, 1]


def test_tool_responses_render_as_the_chat_template_continues_the_conversation():
    tokenizer = build_tokenizer()
    render = tool_response_renderer(tokenizer)
    user = [{"role": "user", "content": "What is 12*34?"}]
    prompt = tokenizer.apply_chat_template(user, tokenize=True, add_generation_prompt=True)["input_ids"]
    sampled = tokenizer("<tool_call>x</tool_call>", add_special_tokens=False)["input_ids"] + [
        tokenizer.eos_token_id
    ]
    tool_ids = render(ToolTurnResult(["408"], 0, ["calculator"]), True, 0)
    assert tokenizer.decode(tool_ids) == "<|tool|>408<|assistant|>"
    conversation = [
        *user,
        {"role": "assistant", "content": "<tool_call>x</tool_call>"},
        {"role": "tool", "content": "408"},
    ]
    whole = tokenizer.apply_chat_template(conversation, tokenize=True, add_generation_prompt=True)
    assert prompt + sampled + tool_ids == whole["input_ids"]


def test_trajectories_become_the_rollout_batch():
    engine = ScriptedEngine([[10, EOS], [20, 21, EOS]])
    trajectory = asyncio.run(tool_loop(engine, calls_in=(0,)).run([5, 6], seed=0))
    mask = torch.tensor([[0, 1, 1]])
    prompts = DataProto.from_dict(
        {
            "input_ids": torch.tensor([[0, 5, 6]]),
            "attention_mask": mask,
            "position_ids": torch.tensor([[0, 0, 1]]),
        }
    )
    batch = trajectories_to_batch(prompts, [trajectory], response_length=10, pad_token_id=0)
    assert batch.batch["responses"][0].tolist() == [10, EOS, 92, 92, 92, 20, 21, EOS, 0, 0]
    assert batch.batch["response_mask"][0].tolist() == [1, 1, 0, 0, 0, 1, 1, 1, 0, 0]
    assert batch.batch["attention_mask"][0].tolist() == [0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0]
    assert batch.batch["position_ids"][0].tolist() == [0, 0, 1, *range(2, 12)]
    assert batch.batch["rollout_versions"][0].tolist() == [7, 7, -1, -1, -1, 7, 7, 7, -1, -1]
    assert batch.batch["rollout_log_probs"][0, 2:5].tolist() == [0, 0, 0]
    assert batch.non_tensor_batch["agent_tool_calls"].tolist() == [1]
    assert batch.non_tensor_batch["agent_tool_tokens"].tolist() == [3]
    # the turns' prompts: [5, 6], then [5, 6, 10, EOS, 92, 92, 92]; blocks of 4 of them cached
    assert batch.batch["prefill_tokens"].tolist() == [2 + 7]
    assert batch.batch["prefix_cached_tokens"].tolist() == [0 + 4]


def test_rewards_see_the_sampled_turns_and_land_on_the_last_sampled_token():
    from hybridflow.algorithms.masked import last_token_lengths
    from hybridflow.reward.manager import place_on_last_token, sequence_scores

    mask = torch.tensor([[1, 1, 0, 0, 1, 0, 0], [1, 1, 1, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0, 0]])
    assert last_token_lengths(mask).tolist() == [5, 3, 0]
    assert place_on_last_token(torch.tensor([2.0, 3.0, 4.0]), mask)[:2].nonzero().tolist() == [[0, 4], [1, 2]]
    tokenizer = build_tokenizer()
    text = "ab|tool|cd"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    batch = DataProto.from_dict(
        {
            "responses": torch.tensor([[*ids, 0, 0]]),
            "response_mask": torch.tensor([[1, 1, 0, 0, 0, 0, 0, 0, 1, 1, 0, 0]]),
        },
        {"data_source": ["x"], "reward_model": [{"ground_truth": ""}]},
    )
    seen = []
    sequence_scores(batch, tokenizer, lambda source, solution, truth, extra: seen.append(solution) or 1.0)
    assert seen == ["ab\ncd"]  # the model's turns, not the tool output between them
