"""The colocated weight sync: the actor's HF-named tensors loaded in memory into a rollout engine that
lives in the actor's own processes (the hybrid engine; see the package docstring for the checks).

    sync = ColocatedWeightSync(actor_chunks, hf_config, engine_or_None, rollout_cfg, rollout_group)
    stats = sync.sync()                   # collective over all ranks; -> SyncStats

The stream is cut into buckets of `rollout.weight_sync_bucket_mb`, loaded inside one
weight-update session per sync (`begin_weight_update` / `end_weight_update`). The hf and vLLM
engines (one per rank; a vLLM engine at TP = T keeps its shard of the full tensors) load full
tensors with `engine.update_weights`. For SGLang every rank of a rollout group serialises its own
copy of the bucket as CUDA-IPC handles on its own GPU (`sglang_rollout.serialize_bucket`), the
group's first rank (which holds the engine) gathers them and hands scheduler i the handles of
member i (on that GPU); the bucket stays alive until the group's first rank says it was loaded.
"""

import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from engines.rollout.base import RolloutEngine
from engines.rollout.config import RolloutConfig
from engines.weight_sync.common import (
    WeightSyncError,
    bucket_named_tensors,
    first_checksum_mismatch,
    tensor_checksum,
    tensor_nbytes,
    torch_dtype,
    weight_stream_problem,
)
from engines.weight_sync.model_shapes import expected_hf_tensor_shapes
from hybridflow.protocol import DataProto

# A wrong or missing tensor moves log-probs by O(1); the rest is kernel rounding in that dtype.
VERIFY_LOG_PROB_TOLERANCE = {"float32": 1e-3, "bfloat16": 0.15, "float16": 0.05}


@dataclass
class SyncStats:
    """One weight sync: tensors and bytes streamed, wall time."""

    tensors: int
    bytes: int
    seconds: float


class ColocatedWeightSync:
    """The actor's weights into this rank's engine (or its rollout group's, for SGLang); construct
    it on every rank at the same time (collective: it checks the stream's names and shapes)."""

    def __init__(
        self,
        actor_chunks: list,
        hf_config,
        engine: RolloutEngine | None,
        rollout_cfg: RolloutConfig,
        rollout_group,
    ):
        self.actor_chunks = actor_chunks
        self.hf_config = hf_config
        self.engine = engine
        self.cfg = rollout_cfg
        self._rollout_group = rollout_group  # the ranks of one engine (SGLang: the first one holds it)
        self._check_stream()
        from engines.megatron.hf_stream import actor_staging

        # On CPU gloo's per-tensor all-gather was nearly all of a TP2 sync: where the actor's TP ranks
        # share a host, the gather goes through one shared buffer, kept for every sync (tp_staging.py).
        self._staging = actor_staging(actor_chunks, hf_config)

    def _check_stream(self) -> None:
        """Collective: a WeightSyncError on every rank, naming the tensor, when the actor's stream
        has a name or shape the rollout model does not take (see the package docstring)."""
        from engines.megatron.hf_stream import actor_stream_shapes

        model_dir = self.hf_config.source_dir
        expected, required = expected_hf_tensor_shapes(model_dir)
        problem = weight_stream_problem(
            actor_stream_shapes(self.actor_chunks, self.hf_config), expected, required
        )
        raise_on_every_rank(problem and f"{problem} (rollout model {model_dir})", "weight sync check")

    def sync(self) -> SyncStats:
        """Stream the actor's HF-named tensors into the engine (collective over all ranks)."""
        from engines.megatron.hf_stream import actor_hf_tensors

        start = time.perf_counter()
        sent: dict[str, str] = {}
        count = nbytes = 0
        # The hf and vllm engines copy what they load into their own parameters within this call, so
        # the stream may hand them the actor's parameters; SGLang's scheduler reads the tensors
        # from another process through CUDA-IPC handles, which must not expose the actor's memory.
        copies = self.cfg.name == "sglang"
        stream = actor_hf_tensors(self.actor_chunks, self.hf_config, copies=copies, staging=self._staging)
        if self.cfg.verify_weight_sync and self.engine is not None:
            stream = _recording_checksums(stream, sent, torch_dtype(self.cfg.dtype))
        failure = self._session_call("begin_weight_update")
        for index, bucket in enumerate(bucket_named_tensors(stream, self.cfg.weight_sync_bucket_mb)):
            count += len(bucket)
            nbytes += sum(tensor_nbytes(tensor) for _, tensor in bucket)
            # After a failure the stream is still consumed (it is a collective), not loaded.
            failure = failure or self._load_bucket(index, bucket)
        closing_failure = self._session_call("end_weight_update")  # closed even after a failure
        failure = failure or closing_failure
        raise_on_every_rank(failure, "weight sync")
        if self.cfg.verify_weight_sync:
            self._verify(sent)
        return SyncStats(tensors=count, bytes=nbytes, seconds=time.perf_counter() - start)

    def _session_call(self, method: str) -> str | None:
        """Open or close the engine's weight-update session; the failure, if any."""
        if self.engine is None:
            return None
        try:
            getattr(self.engine, method)()
        except WeightSyncError as err:
            return str(err)
        except Exception as err:  # e.g. out of memory: reported to every rank, see `_load_bucket`
            return f"{method}: {type(err).__name__}: {err}"
        return None

    def _load_bucket(self, index: int, bucket: list[tuple[str, torch.Tensor]]) -> str | None:
        """Load one bucket into this rank's engine (or its rollout group's); the failure, if any."""
        where = f"bucket {index} ({bucket[0][0]} .. {bucket[-1][0]})"
        if self.cfg.name == "sglang":
            return self._load_bucket_in_group(where, bucket)
        if self.engine is None:
            return None
        try:
            self.engine.update_weights(bucket)
        except (ValueError, WeightSyncError) as err:
            return f"{where}: {err}"
        except Exception as err:
            # Any error (out of memory ...) is this rank's outcome, raised on every rank once the stream
            # is consumed: raised here, it would leave the other ranks waiting in the stream's
            # collectives for this one.
            return f"{where}: {type(err).__name__}: {err}"
        return None

    def _load_bucket_in_group(self, where: str, bucket: list[tuple[str, torch.Tensor]]) -> str | None:
        """SGLang: every member's CUDA-IPC handles of its own copy to the group's engine."""
        from engines.rollout.sglang_rollout import serialize_bucket

        group = self._rollout_group
        payloads: list | None = [None] * dist.get_world_size(group) if self.engine is not None else None
        leader = dist.get_global_rank(group, 0)
        dist.gather_object(serialize_bucket(bucket), payloads, dst=leader, group=group)
        outcome: list[str | None] = [None]
        if self.engine is not None:
            try:
                self.engine.update_weights_from_rank_payloads(payloads)
            except WeightSyncError as err:
                outcome[0] = f"{where}: {err}"
            except Exception as err:  # see `_load_bucket`
                outcome[0] = f"{where}: {type(err).__name__}: {err}"
        # The handles point into this rank's bucket: keep it alive until the engine has loaded it.
        dist.broadcast_object_list(outcome, src=leader, group=group)
        return outcome[0]

    def _verify(self, sent: dict[str, str]) -> None:
        """Compare the engine's checksums with the sent ones; raise on every rank if any rank differs."""
        if self.cfg.name == "vllm":
            self.verify_log_probs()
            return
        problem = None
        if self.engine is not None:
            received = self.engine.weight_checksums()
            aliases = [name for name in sent if name not in received]  # e.g. a tied lm_head.weight
            received.update(self.engine.weight_checksums(aliases))
            mismatch = first_checksum_mismatch(sent, received)
            unsynced = [name for name in received if name not in sent]
            if mismatch is not None:
                problem = (
                    f"rollout weight {mismatch!r} differs from the actor's after the sync "
                    f"(first mismatch in sync order, of {len(sent)} tensors)"
                )
            elif unsynced:
                problem = f"rollout weights {unsynced[:5]} were not in the actor's weight stream"
        raise_on_every_rank(problem, "verify_weight_sync")

    def verify_log_probs(self) -> None:
        """vLLM repacks its weights, so no exact read-back: its log-probs of fixed tokens must equal
        the actor's within the rollout dtype's tolerance (collective; raises on every rank)."""
        from engines.megatron.forward import compute_log_prob

        probe = log_prob_probe(self.hf_config.vocab_size)
        result = compute_log_prob(self.actor_chunks, probe, len(probe), calculate_entropy=False)
        # Only last pipeline stages hold the result; every rank's engine is checked against it.
        results: list[torch.Tensor | None] = [None] * dist.get_world_size()
        dist.all_gather_object(results, None if result is None else result.batch["old_log_probs"])
        actor = next(r for r in results if r is not None)  # (B, R)
        problem = None
        if self.engine is not None:
            engine = self.engine.score_log_probs(probe.batch["input_ids"].tolist())[:, -actor.shape[1] :]
            worst = float((actor - engine).abs().max())
            tolerance = VERIFY_LOG_PROB_TOLERANCE[self.cfg.dtype]
            if not worst <= tolerance:
                problem = (
                    f"the rollout engine's log-probs of fixed tokens differ from the actor's by up to "
                    f"{worst:.3g} (tolerance {tolerance} for rollout.dtype={self.cfg.dtype}): its weights "
                    "are not the actor's"
                )
        raise_on_every_rank(problem, "verify_weight_sync")


def log_prob_probe(vocab_size: int, rows: int = 4, prompt: int = 4, response: int = 12) -> DataProto:
    """Fixed token sequences (the same on every rank) whose log-probs the actor and an engine compare."""
    ids = torch.randint(0, vocab_size, (rows, prompt + response), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(prompt + response).expand(rows, -1)
    tensors = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "position_ids": positions}
    return DataProto.from_dict({**tensors, "responses": ids[:, prompt:]})


def raise_on_every_rank(problem: str | None, what: str) -> None:
    """Collective: raise WeightSyncError on every rank if any rank had a problem (the first one)."""
    problems: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(problems, problem)
    for rank, text in enumerate(problems):
        if text is not None:
            raise WeightSyncError(f"{what} on rank {rank}: {text}")


def _recording_checksums(
    stream: Iterable[tuple[str, torch.Tensor]], sent: dict[str, str], dtype: torch.dtype
) -> Iterator[tuple[str, torch.Tensor]]:
    """Pass the stream through, recording each tensor's checksum as the engine will store it."""
    for name, tensor in stream:
        sent[name] = tensor_checksum(tensor.to(dtype))
        yield name, tensor
