"""The rollout handle a recipe asks for (see the package docstring for what each one does):

    trainer.placement colocated                 ColocatedRollout(policy group)
    disaggregated, async_training.mode sync     PoolRollout(rollout group)
    disaggregated, sync, agent loop tool/openai RoutedAgentRollout(PoolRollout): each turn routed
    disaggregated, one_step / async             GeneratingAhead(PoolRollout, depth)
    disaggregated, stream                       StreamingRollout(PoolRollout)

The recipe check allows the async modes with the disaggregated placement only.
"""

import functools
from pathlib import Path

from hybridflow.config.schema import RecipeConfig
from hybridflow.single_controller.errors import CallDeadline
from hybridflow.trainer.prompts import PromptBatches
from hybridflow.trainer.rollout.ahead import GeneratingAhead, generation_depth
from hybridflow.trainer.rollout.base import Rollout
from hybridflow.trainer.rollout.colocated import ColocatedRollout
from hybridflow.trainer.rollout.pool import PoolRollout
from hybridflow.trainer.rollout.routed import RoutedAgentRollout
from hybridflow.trainer.rollout.stream import EngineDeadlines, RayGroupCalls, StreamingRollout, StreamSettings
from hybridflow.workers.protocols import HybridPolicyGroup, RolloutGroup, TransferPolicyGroup


def make_rollout(
    cfg: RecipeConfig,
    policy_group: HybridPolicyGroup | TransferPolicyGroup,
    rollout_group: RolloutGroup | None,
    prompts: PromptBatches,
    pad_token_id: int,
) -> Rollout:
    """The recipe's rollout: over the policy's own engines when there is no rollout pool
    (`rollout_group` None, a HybridPolicyGroup), else over the pool, wrapped by the recipe's async
    mode. `prompts`: the loader's batches the trainer's steps take (a rollout generating ahead draws
    from them too)."""
    if rollout_group is None:
        return ColocatedRollout(policy_group)
    pool = PoolRollout(rollout_group, cfg.trainer.output_dir, cfg.rollout)
    if cfg.rollout.agent.loop in ("tool", "openai"):  # the loops run here, their turns routed
        return routed_agent_rollout(cfg, pool)
    if cfg.trainer.async_training.mode == "stream":  # groups generate on as steps take them
        calls = RayGroupCalls(rollout_group, EngineDeadlines.of(cfg))
        return StreamingRollout(pool, calls, StreamSettings.of(cfg, pad_token_id))
    if generation_depth(cfg) > 0:  # one_step / async: the next batches generate during the update
        return GeneratingAhead(pool, generation_depth(cfg), prompts, cfg.trainer.async_training.sync_every)
    return pool


def routed_agent_rollout(cfg: RecipeConfig, pool: PoolRollout) -> RoutedAgentRollout:
    """The recipe's agents on the driver (tool loops, or its OpenAI-client agent and endpoint), with
    the model's tokenizer and its EOS and pad ids as the engines read them, each request bounded by
    trainer.worker_call_timeout_s."""
    from transformers import AutoConfig, AutoTokenizer

    from engines.rollout.base import read_special_token_ids
    from hybridflow.agents.openai_loop import OpenAIAgentRollout, load_openai_agent
    from hybridflow.agents.rollout import SessionToolLoops, ToolLoops

    rollout = cfg.rollout
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer_path or cfg.model.path)
    eos, pad = read_special_token_ids(Path(cfg.model.path), AutoConfig.from_pretrained(cfg.model.path))
    deadline = CallDeadline(cfg.trainer.worker_call_timeout_s, "trainer.worker_call_timeout_s")
    if rollout.agent.loop == "openai":
        agent = load_openai_agent(rollout.agent.openai_agent)

        def make(request):
            return OpenAIAgentRollout(agent, request, tokenizer, rollout, pad, eos)
    else:
        loops = ToolLoops(rollout, tokenizer, eos)
        make = functools.partial(SessionToolLoops, loops, cfg=rollout, pad_token_id=pad)
    return RoutedAgentRollout(pool, make, cfg.trainer.output_dir, deadline)
