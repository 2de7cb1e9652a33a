"""The environment loop reports the metrics of its episodes (turns, steps, observation tokens),
not the tool loop's counts of tool calls, which it never makes."""

import torch

from engines.rollout.config import AgentConfig, EnvironmentConfig, RolloutConfig
from hybridflow.agents.environments import EnvironmentRollout, Episode
from hybridflow.protocol import DataProto
from hybridflow.trainer.metrics import agent_metrics


class OneEpisode:
    """A loop whose every episode is two sampled turns with an observation between them, one step."""

    async def run(self, prompt_ids, seed, messages, reset_seed):
        episode = Episode(response_ids=[5, 6, 7, 8], response_mask=[1, 0, 0, 1], turns=2)
        episode.log_probs, episode.versions = [0.0] * 4, [0, -1, -1, 0]
        episode.step_rewards, episode.reward_positions, episode.done = [1.0], [3], True
        return episode


def test_the_environment_loop_reports_no_tool_call_metrics():
    cfg = RolloutConfig(
        name="vllm",
        response_length=6,
        agent=AgentConfig(loop="environment", environment=EnvironmentConfig(url="http://env")),
    )
    rollout = EnvironmentRollout(lambda sampling: OneEpisode(), cfg, pad_token_id=0)
    prompts = DataProto.from_dict(
        {
            "input_ids": torch.tensor([[1, 2], [3, 4]]),
            "attention_mask": torch.ones(2, 2, dtype=torch.long),
            "position_ids": torch.tensor([[0, 1], [0, 1]]),
        },
        non_tensors={"raw_prompt": [[{"role": "user", "content": "Play."}]] * 2},
        meta_info={"n": 1},
    )
    metrics = agent_metrics(rollout.generate_sequences(prompts).non_tensor_batch)
    assert metrics == {
        "agent/turns/mean": 2.0,
        "agent/tool_tokens/mean": 2.0,
        "agent/env_steps/mean": 1.0,
        "agent/env_done/mean": 1.0,
    }
