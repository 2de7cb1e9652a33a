"""Step metrics computed on the driver from the batch, plus timing and throughput.

Names are the ones metrics.jsonl promises (`reward/mean`, `response_length/mean`, `kl/mean`,
`timing/<stage>`, `throughput/tokens_per_s`, ...); worker metrics arrive as lists in
`meta_info["metrics"]` and are averaged.
"""

import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import numpy as np
import torch

from engines.rollout.base import CACHED_KEY, PREFILL_KEY, REPLICA_KEY
from hybridflow.algorithms import masked_mean
from hybridflow.algorithms.distillation import distillation_metrics
from hybridflow.protocol import DataProto


@contextmanager
def timer(stage: str, timings: dict[str, float]) -> Iterator[None]:
    """Adds the wall time of the block to `timings[stage]` (seconds)."""
    start = time.perf_counter()
    yield
    timings[stage] = timings.get(stage, 0.0) + time.perf_counter() - start


def mean_worker_metrics(output: DataProto) -> dict[str, float]:
    """The mean of each metric a worker call reported (one value per micro-batch and rank); the
    largest value for a metric named `..._max` (e.g. update_ratio_max)."""
    return {
        key: float(np.max(values) if key.endswith("_max") else np.mean(values))
        for key, values in output.meta_info.get("metrics", {}).items()
    }


def batch_metrics(batch: DataProto) -> dict[str, float]:
    """Reward, lengths, advantages (and values/returns, KL when present) of a trained batch."""
    tensors = batch.batch
    response_mask = tensors["response_mask"].float()  # (B, R)
    response_length = response_mask.sum(dim=-1)  # (B,)
    # tool-response tokens (agent loops) sit in the response with response_mask 0
    prompt_length = tensors["attention_mask"][:, : -response_mask.size(1)].sum(dim=-1).float()  # (B,)
    scores = tensors["token_level_scores"].sum(dim=-1)  # (B,)
    metrics = {
        "reward/mean": scores.mean().item(),
        "reward/max": scores.max().item(),
        "reward/min": scores.min().item(),
        "response_length/mean": response_length.mean().item(),
        "response_length/max": response_length.max().item(),
        # a response that fills every position was cut off rather than ending with EOS
        "response_length/clip_ratio": (response_length == response_mask.size(1)).float().mean().item(),
        "prompt_length/mean": prompt_length.mean().item(),
        "advantages/mean": masked_mean(tensors["advantages"], response_mask).item(),
    }
    if "values" in tensors:
        metrics["critic/values_mean"] = masked_mean(tensors["values"], response_mask).item()
        metrics["critic/returns_mean"] = masked_mean(tensors["returns"], response_mask).item()
    if "ref_log_prob" in tensors:
        metrics["kl/mean"] = policy_ref_kl(tensors["old_log_probs"], tensors["ref_log_prob"], response_mask)
    if "teacher_log_prob" in tensors:
        metrics |= distillation_metrics(tensors["old_log_probs"], tensors["teacher_log_prob"], response_mask)
    metrics |= rollout_replica_metrics(tensors)
    return metrics | source_rewards(scores, batch.non_tensor_batch) | agent_metrics(batch.non_tensor_batch)


def rollout_replica_metrics(tensors) -> dict[str, float]:
    """The share of the batch's prompt tokens that vLLM's prefix cache served
    (`rollout/prefix_cache_hit_rate`) and, from a rollout pool, each replica's (process's) samples,
    response tokens and hit rate (`rollout/replica_<rank>/...`)."""
    if PREFILL_KEY not in tensors:
        return {}
    prefilled, cached = tensors[PREFILL_KEY], tensors[CACHED_KEY]  # (B,), (B,)
    out = prefix_cache_hit_rate("rollout", prefilled, cached)
    if REPLICA_KEY not in tensors:
        return out
    replicas = tensors[REPLICA_KEY]  # (B,)
    for replica in replicas.unique().tolist():
        mine = replicas == replica  # (B,)
        name = f"rollout/replica_{replica}"
        out[f"{name}/samples"] = float(mine.sum())
        out[f"{name}/response_tokens"] = float(tensors["response_mask"][mine].sum())
        out |= prefix_cache_hit_rate(name, prefilled[mine], cached[mine])
    return out


def prefix_cache_hit_rate(name: str, prefilled: torch.Tensor, cached: torch.Tensor) -> dict[str, float]:
    """`<name>/prefix_cache_hit_rate`: cached over prefilled prompt tokens (none without any)."""
    total = int(prefilled.sum())
    return {f"{name}/prefix_cache_hit_rate": int(cached.sum()) / total} if total else {}


def source_rewards(scores: torch.Tensor, non_tensors: Mapping[str, np.ndarray]) -> dict[str, float]:
    """`reward/<data_source>/mean` of each data source in a batch that mixes several (reasoning-gym
    tasks, a GSM8K + MATH mix); with one source that is reward/mean, and nothing is added."""
    sources = np.asarray(non_tensors.get("data_source", []), dtype=object)  # (B,)
    if len(set(sources)) < 2:
        return {}
    return {
        f"reward/{source}/mean": scores[torch.from_numpy(sources == source)].mean().item()
        for source in dict.fromkeys(sources)
    }


def agent_metrics(non_tensors: Mapping[str, np.ndarray], prefix: str = "agent") -> dict[str, float]:
    """Per-trajectory means of agent loops' counts (`agent_<name>` arrays: turns, tool calls, tool
    errors, tool tokens), and `tool_success_rate`: the share of trajectories in which at least one
    tool call ran without error."""
    counts = {k.removeprefix("agent_"): v for k, v in non_tensors.items() if k.startswith("agent_")}
    out = {f"{prefix}/{name}/mean": float(np.mean(values)) for name, values in counts.items()}
    if "tool_calls" in counts:
        succeeded = np.asarray(counts["tool_calls"]) > np.asarray(counts["tool_errors"])
        out[f"{prefix}/tool_success_rate"] = float(np.mean(succeeded))
    return out


def policy_ref_kl(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, response_mask: torch.Tensor) -> float:
    """Mean per-token log(pi / pi_ref) of the sampled tokens (the k1 estimate of KL(pi || pi_ref))."""
    return masked_mean(log_probs - ref_log_probs, response_mask).item()


def throughput(batch: DataProto, step_seconds: float) -> dict[str, float]:
    """Tokens (prompt + response, no padding) processed per second of the step."""
    tokens = batch.batch["attention_mask"].sum().item()
    return {"throughput/tokens_per_s": tokens / max(step_seconds, 1e-9)}


def timing_metrics(timings: dict[str, float]) -> dict[str, float]:
    return {f"timing/{stage}": seconds for stage, seconds in timings.items()}
