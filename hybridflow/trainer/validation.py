"""Validation: greedy responses to the validation prompts, scored by the rule reward; accuracy
overall and per data source, and with an agent loop its tool-call counts (val/agent/...)."""

from collections import defaultdict

import numpy as np

from hybridflow.protocol import PIXEL_VALUES_KEY, DataProto, DataProtoConfig
from hybridflow.reward.manager import sequence_scores
from hybridflow.reward.registry import RewardFn
from hybridflow.trainer.metrics import agent_metrics

PROMPT_KEYS = ["input_ids", "attention_mask", "position_ids"]


def accuracy_metrics(scores: list[float], data_sources: list[str]) -> dict[str, float]:
    """`val/accuracy` (mean score) and `val/<data_source>/accuracy` for each source."""
    by_source = defaultdict(list)
    for score, source in zip(scores, data_sources, strict=True):
        by_source[source].append(score)
    metrics = {"val/accuracy": float(np.mean(scores))}
    metrics.update({f"val/{source}/accuracy": float(np.mean(values)) for source, values in by_source.items()})
    return metrics


def pop_prompts(batch: DataProto, with_rows: bool = False) -> DataProto:
    """The prompts to generate from, popped from `batch` (image prompts' pixels included: the
    engines' outputs carry them on); `with_rows` adds (shares) the rows' other fields (messages,
    data source, ...), for rollouts that read them (agent loop: openai)."""
    images = [PIXEL_VALUES_KEY] if PIXEL_VALUES_KEY in batch.non_tensor_batch else []
    prompts = batch.pop(batch_keys=PROMPT_KEYS, non_tensor_batch_keys=images)
    if with_rows:
        prompts.non_tensor_batch.update(batch.non_tensor_batch)
    return prompts


def run_validation(
    rollout, batches, tokenizer, reward_fn: RewardFn, with_rows: bool = False
) -> dict[str, float]:
    """Generates with the rollout handle's validation sampling (greedy by default) for every batch of
    prompts and scores the responses. With the rule reward and format_score 0 the mean score is
    the accuracy. Where the engines stamp each response with the policy version that produced it
    (rollout pools), `val/policy_version` is the newest of them."""
    scores, sources, versions, agent_counts = [], [], [], defaultdict(list)
    for batch_dict in batches:
        batch = DataProto.from_single_dict(batch_dict)
        prompts = pop_prompts(batch, with_rows)
        # the validation set need not split evenly over the data-parallel ranks
        prompts.meta_info.update({"validate": True, "n": 1, DataProtoConfig.auto_padding_key: True})
        batch = batch.union(rollout.generate(prompts))
        scores += sequence_scores(batch, tokenizer, reward_fn).tolist()
        sources += list(batch.non_tensor_batch["data_source"])
        if "policy_version" in batch.batch:
            versions += batch.batch["policy_version"].tolist()
        for key, values in batch.non_tensor_batch.items():
            if key.startswith("agent_"):
                agent_counts[key] += values.tolist()
    agent = agent_metrics({key: np.array(values) for key, values in agent_counts.items()}, "val/agent")
    served = {"val/policy_version": float(max(versions))} if versions else {}
    return accuracy_metrics(scores, sources) | agent | served
