"""The hybrid engine's switch from training to generation: actor weights into the rollout engine,
and the batch reshaped between the actor's data-parallel layout and the rollout engines.

    with sharding_manager:                          # resume, sync weights, resume the KV cache
        piece = sharding_manager.preprocess_data(prompts)
        out = engine.generate_sequences(piece) if engine is not None else None
        out = sharding_manager.postprocess_data(out)
                                                    # on exit: release the engine's memory

Engine memory (with `rollout.free_cache_engine`, the default). The engine's memory is released
as soon as the manager is built (the actor trains next), and each entry resumes it in two steps
so that the peak is the weights plus the actor, never the KV cache plus the actor plus buckets:
`before_resume` hook (the actor's optimizer state and gradients to host memory, the allocator's
cache emptied) -> resume "weights" -> stream the weights -> `after_sync` hook (the actor's
parameters to host memory) -> resume "kv_cache" and "cuda_graph" -> flush the cache; exit
releases everything, then the `after_release` hook brings the actor's state back. The manager
tracks what is released and never resumes memory that is not (SGLang's scheduler dies on that).
With `free_cache_engine: false` nothing is ever released or resumed; entries only sync and flush.

Weights. On entry every rank of the actor's model-parallel group iterates
`engines.megatron.weights.iter_hf_tensors` in lockstep (it is a collective); the stream is cut into
buckets of `rollout.weight_sync_bucket_mb`, loaded inside one weight-update session per sync
(`begin_weight_update` / `end_weight_update`). The hf engine (one rank per engine) loads full
tensors with `engine.update_weights`. For SGLang every rank of a rollout group serialises its own
copy of the bucket as CUDA-IPC handles on its own GPU (`sglang_rollout.serialize_bucket`), the
group's first rank gathers them and hands scheduler i the handles of member i (on that GPU); the
bucket stays alive until the group's first rank says it was loaded. An update SGLang refuses
(outside a session) becomes a `WeightSyncError` naming the bucket and SGLang's message, raised on
every rank after the stream is consumed (so that no rank is left waiting in the collective).
A load that *fails* inside SGLang returns nothing: the scheduler's exception kills the engine's
whole process tree, this worker included (sglang 0.5.23 managers/scheduler.py 6369,
tokenizer_manager.py 4072-4081), and an unknown name is skipped with only a warning (models/qwen2.py
719). So the names and shapes of the stream are checked when the manager is built, against the
model in `hf_config.source_dir` (the directory the rollout engine serves) built on the meta device,
and a mismatch stops every rank with a `WeightSyncError` naming the tensor, before anything is
sent. With `rollout.verify_weight_sync`, each tensor's checksum (cast to the rollout dtype) is
compared with the engine's copy after the sync; the first differing name stops the run on every
rank. vLLM repacks its weights (no exact read-back): there the engine's log-probs of fixed tokens
are compared with the actor's instead, within a tolerance of the rollout dtype.

LoRA with `actor.lora.sync=adapters` (vLLM, docs/lora.md): the first sync streams the frozen base
weights (the stream inside `adapters_disabled`), then every sync gathers the adapters whole on
every rank (`lora.iter_lora_tensors`, peft names) and each engine loads them as its new LoRA
adapter (engines/rollout/vllm_lora.py); a failure there stops every rank with a WeightSyncError.

Data. MEGATRON_COMPUTE_PROTO gives the same chunk to every rank of one actor data-parallel rank
(its "replica group": all its TP/PP/CP ranks) and collects from one of them. So that each prompt
is generated once:
  - `preprocess_data`: rank i of a replica group of size M keeps the i-th of M near-equal slices of
    the chunk; then, when an engine spans several ranks (SGLang TP = T: ranks [kT, (k+1)T) form a
    rollout group and its first rank holds the engine), the group's slices are all-gathered in rank
    order, so the engine sees its whole group's prompts;
  - `postprocess_data`: the engine rank hands each member of its rollout group the output rows of
    that member's slice (n output rows per prompt row when the engine samples n), then the replica
    group all-gathers, so every rank (the collected tp0 / last-stage rank included) returns the
    output of its whole chunk, in the chunk's row order.
With the hf engine (no TP) every rank holds an engine and rollout groups are single ranks. With
vLLM at TP = T every rank of a rollout group holds an engine (vLLM's external launcher: one TP
shard each): all members get the group's prompts and the same seed stream, load the full tensors
of every bucket (vLLM's loaders keep their shard), and each keeps its own slice's output rows.
"""

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from engines.rollout.base import (
    CUDA_GRAPH_TAG,
    KV_CACHE_TAG,
    SEED_STREAM_KEY,
    WEIGHTS_TAG,
    RolloutEngine,
)
from engines.rollout.config import RolloutConfig
from engines.rollout.weight_sync import (
    WeightSyncError,
    bucket_named_tensors,
    expected_hf_tensor_shapes,
    first_checksum_mismatch,
    tensor_checksum,
    tensor_nbytes,
    torch_dtype,
    weight_stream_problem,
)
from hybridflow.protocol import DataProto, all_gather_data_proto

ALL_TAGS = [WEIGHTS_TAG, KV_CACHE_TAG, CUDA_GRAPH_TAG]
# A wrong or missing tensor moves log-probs by O(1); the rest is kernel rounding in that dtype.
VERIFY_LOG_PROB_TOLERANCE = {"float32": 1e-3, "bfloat16": 0.15, "float16": 0.05}


@dataclass
class OffloadHooks:
    """What the worker does around generation with the actor's own state (offload.py on GPU)."""

    before_resume: Callable[[], None] | None = None  # e.g. the optimizer state and gradients to host
    after_sync: Callable[[], None] | None = None  # e.g. the parameters to host (synced, unused now)
    after_release: Callable[[], None] | None = None  # e.g. bring it all back before the next update


@dataclass
class SyncStats:
    """One weight sync: tensors and bytes streamed, wall time."""

    tensors: int
    bytes: int
    seconds: float


@dataclass
class _Group:
    """One process group this rank belongs to, with its rank in it."""

    group: object
    rank: int
    size: int


class MegatronRolloutShardingManager:
    """Context manager around generation; construct it on every rank at the same time (collective)."""

    def __init__(
        self,
        actor_chunks: list,
        hf_config,
        rollout_engine: RolloutEngine | None,
        rollout_cfg: RolloutConfig,
        offload_hooks: OffloadHooks | None = None,
    ):
        from megatron.core import parallel_state

        self.actor_chunks = actor_chunks
        self.hf_config = hf_config
        self.engine = rollout_engine
        self.cfg = rollout_cfg
        self.hooks = offload_hooks or OffloadHooks()
        self.last_sync: SyncStats | None = None
        self._replica = _group_by_key(parallel_state.get_data_parallel_rank())
        self._rollout = _group_by_key(dist.get_rank() // rollout_cfg.tensor_model_parallel_size)
        # SGLang: the group's first rank holds the engine, which drives the group's GPUs itself.
        # vLLM (external_launcher) and hf: every rank holds an engine (a TP shard or a replica).
        self._leader_holds_engine = rollout_cfg.name == "sglang"
        holds_engine = self._rollout.rank == 0 or not self._leader_holds_engine
        if holds_engine != (rollout_engine is not None):
            who = "the first rank of each group of" if self._leader_holds_engine else "every rank of"
            raise ValueError(
                f"rank {dist.get_rank()}: {who} rollout.tensor_model_parallel_size="
                f"{rollout_cfg.tensor_model_parallel_size} ranks must hold a {rollout_cfg.name} engine and "
                f"no other rank; this rank {'lacks' if holds_engine else 'has'} one"
            )
        self._check_weight_stream()
        self._adapter_config = _adapter_sync_config(actor_chunks, hf_config)
        self._base_synced = False
        self._slice_sizes: list[int] = []
        self._released: set[str] = set()
        if self.engine is not None and rollout_cfg.free_cache_engine:
            self._release(ALL_TAGS)  # a new engine holds its memory; the actor trains first

    # ------------------------------------------------------------------ context
    def __enter__(self):
        if self.hooks.before_resume is not None:
            self.hooks.before_resume()
        self._resume([WEIGHTS_TAG])
        self.sync_weights()
        if self.hooks.after_sync is not None:
            self.hooks.after_sync()
        self._resume([KV_CACHE_TAG, CUDA_GRAPH_TAG])
        if self.engine is not None:
            self.engine.flush_cache()
        return self

    def __exit__(self, exc_type, exc_value, traceback):
        if self.cfg.free_cache_engine:
            self._release(ALL_TAGS)
        if self.hooks.after_release is not None:
            self.hooks.after_release()
        return False

    def _release(self, tags: list[str]) -> None:
        pending = [tag for tag in tags if tag not in self._released]
        if self.engine is not None and pending:
            self.engine.release_memory(pending)
            self._released.update(pending)

    def _resume(self, tags: list[str]) -> None:
        pending = [tag for tag in tags if tag in self._released]
        if self.engine is not None and pending:
            self.engine.resume_memory(pending)
            self._released.difference_update(pending)

    # ------------------------------------------------------------------ weights
    def _check_weight_stream(self) -> None:
        """Collective: a WeightSyncError on every rank, naming the tensor, when the actor's stream
        has a name or shape the rollout model does not take (see the module docstring)."""
        from engines.megatron.weights import stream_tensor_shapes

        model_dir = self.hf_config.source_dir
        expected, required = expected_hf_tensor_shapes(model_dir)
        problem = weight_stream_problem(
            stream_tensor_shapes(self.actor_chunks, self.hf_config), expected, required
        )
        _raise_on_every_rank(problem and f"{problem} (rollout model {model_dir})", "weight sync check")

    def sync_weights(self) -> SyncStats:
        """Bring the engine to the actor's weights (collective over all ranks): stream the actor's
        HF-named tensors, or with `actor.lora.sync=adapters` only its LoRA adapters after a first
        stream of the frozen base weights."""
        if self._adapter_config is None:
            self.last_sync = self._stream_weights()
            return self.last_sync
        from engines.megatron.lora import adapters_disabled

        start = time.perf_counter()
        base = SyncStats(tensors=0, bytes=0, seconds=0.0)
        if not self._base_synced:
            with adapters_disabled(self.actor_chunks):  # the stream is then the unmerged base
                base = self._stream_weights()
            self._base_synced = True
        count, nbytes = self._send_adapters()
        if self.cfg.verify_weight_sync:
            self._verify_log_probs()
        seconds = time.perf_counter() - start
        self.last_sync = SyncStats(tensors=base.tensors + count, bytes=base.bytes + nbytes, seconds=seconds)
        return self.last_sync

    def _send_adapters(self) -> tuple[int, int]:
        """Gather the whole adapters (peft names) on every rank and load them into this rank's
        engine as its new LoRA adapter; the tensor count and bytes sent."""
        from engines.megatron.lora import iter_lora_tensors

        tensors = dict(iter_lora_tensors(self.actor_chunks))
        failure = None
        if self.engine is not None:
            try:
                self.engine.load_adapter(tensors, self._adapter_config)
            except (ValueError, RuntimeError) as err:
                failure = f"loading the LoRA adapters into {self.cfg.name}: {err}"
        _raise_on_every_rank(failure, "adapter sync")
        return len(tensors), sum(tensor_nbytes(tensor) for tensor in tensors.values())

    def _stream_weights(self) -> SyncStats:
        """Stream the actor's HF-named tensors into the engine (collective over all ranks)."""
        from engines.megatron.weights import iter_hf_tensors

        start = time.perf_counter()
        sent: dict[str, str] = {}
        count = nbytes = 0
        # The hf and vllm engines copy what they load into their own parameters within this call, so
        # the stream may hand them the actor's parameters; SGLang's scheduler reads the tensors
        # from another process through CUDA-IPC handles, which must not expose the actor's memory.
        copies = self.cfg.name == "sglang"
        stream = iter_hf_tensors(self.actor_chunks, self.hf_config, copies=copies)
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
        _raise_on_every_rank(failure, "weight sync")
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
        return None

    def _load_bucket(self, index: int, bucket: list[tuple[str, torch.Tensor]]) -> str | None:
        """Load one bucket into this rank's engine (or its rollout group's); the failure, if any."""
        where = f"bucket {index} ({bucket[0][0]} .. {bucket[-1][0]})"
        if self.cfg.name != "sglang":
            if self.engine is None:
                return None
            try:
                self.engine.update_weights(bucket)
            except (ValueError, WeightSyncError) as err:
                return f"{where}: {err}"
            return None
        from engines.rollout.sglang_rollout import serialize_bucket

        payloads: list | None = [None] * self._rollout.size if self.engine is not None else None
        leader = dist.get_global_rank(self._rollout.group, 0)
        dist.gather_object(serialize_bucket(bucket), payloads, dst=leader, group=self._rollout.group)
        outcome: list[str | None] = [None]
        if self.engine is not None:
            try:
                self.engine.update_weights_from_rank_payloads(payloads)
            except WeightSyncError as err:
                outcome[0] = f"{where}: {err}"
        # The handles point into this rank's bucket: keep it alive until the engine has loaded it.
        dist.broadcast_object_list(outcome, src=leader, group=self._rollout.group)
        return outcome[0]

    def _verify(self, sent: dict[str, str]) -> None:
        """Compare the engine's checksums with the sent ones; raise on every rank if any rank differs."""
        if self.cfg.name == "vllm":
            self._verify_log_probs()
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
        _raise_on_every_rank(problem, "verify_weight_sync")

    def _verify_log_probs(self) -> None:
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
        _raise_on_every_rank(problem, "verify_weight_sync")

    # ------------------------------------------------------------------ data
    def preprocess_data(self, data: DataProto) -> DataProto:
        """This rank's slice of its replica group's chunk, gathered over its rollout group, tagged
        with this rank's seed stream (see `engines.rollout.base`)."""
        bounds = _even_bounds(len(data), self._replica.size)
        piece = data[bounds[self._replica.rank] : bounds[self._replica.rank + 1]]
        if self._rollout.size == 1:
            self._slice_sizes = [len(piece)]
        else:
            sizes: list[int | None] = [None] * self._rollout.size
            dist.all_gather_object(sizes, len(piece), group=self._rollout.group)
            self._slice_sizes = sizes
            piece = all_gather_data_proto(piece, self._rollout.group)
        # The ranks of one TP engine must draw the same samples: the group's first rank names the stream.
        piece.meta_info[SEED_STREAM_KEY] = dist.get_global_rank(self._rollout.group, 0)
        return piece

    def postprocess_data(self, output: DataProto | None) -> DataProto:
        """The output of this rank's whole chunk (on every rank); `output` is None off engine ranks."""
        if self.engine is not None and output is None:
            raise ValueError("postprocess_data: this rank holds the rollout engine but got no output")
        if output is not None:
            output.meta_info.pop(SEED_STREAM_KEY, None)
        if self._rollout.size == 1:
            mine = output
        elif self._leader_holds_engine:
            mine = self._scatter_in_rollout_group(output)
        else:  # every rank of the group generated the group's output: keep this rank's rows
            bounds = self._output_bounds(len(output))
            mine = output[bounds[self._rollout.rank] : bounds[self._rollout.rank + 1]]
        if self._replica.size == 1:
            return mine
        return all_gather_data_proto(mine, self._replica.group)

    def _scatter_in_rollout_group(self, output: DataProto | None) -> DataProto:
        parts: list[DataProto] | None = None
        if self._rollout.rank == 0:
            bounds = self._output_bounds(len(output))
            parts = [output[bounds[i] : bounds[i + 1]] for i in range(self._rollout.size)]
        received: list[DataProto | None] = [None]
        leader = dist.get_global_rank(self._rollout.group, 0)
        dist.scatter_object_list(received, parts, src=leader, group=self._rollout.group)
        return received[0]

    def _output_bounds(self, rows: int) -> list[int]:
        """Offsets of each group member's rows in the engine's output (n rows per prompt row)."""
        rows_per_prompt, rest = divmod(rows, sum(self._slice_sizes))
        if rest or rows_per_prompt < 1:
            raise ValueError(f"engine returned {rows} rows for {sum(self._slice_sizes)} prompts")
        return _offsets([size * rows_per_prompt for size in self._slice_sizes])


def _adapter_sync_config(actor_chunks, hf_config) -> dict | None:
    """peft's adapter config of the actor's adapters when they are synced alone
    (`actor.lora.sync=adapters`), else None (the weights are synced merged)."""
    from engines.megatron.lora import peft_adapter_config
    from engines.megatron.model import unwrap_model

    lora = getattr(unwrap_model(actor_chunks[0]), "lora_config", None)
    if lora is None or not lora.rank or lora.sync != "adapters":
        return None
    return peft_adapter_config(lora, str(hf_config.source_dir))


def log_prob_probe(vocab_size: int, rows: int = 4, prompt: int = 4, response: int = 12) -> DataProto:
    """Fixed token sequences (the same on every rank) whose log-probs the actor and an engine compare."""
    ids = torch.randint(0, vocab_size, (rows, prompt + response), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(prompt + response).expand(rows, -1)
    tensors = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "position_ids": positions}
    return DataProto.from_dict({**tensors, "responses": ids[:, prompt:]})


def _raise_on_every_rank(problem: str | None, what: str) -> None:
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


def _group_by_key(key: int) -> _Group:
    """Partition the world by `key` (collective: every rank calls it with its own key)."""
    keys: list[int | None] = [None] * dist.get_world_size()
    dist.all_gather_object(keys, key)
    members: dict[int, list[int]] = {}
    for rank, k in enumerate(keys):
        members.setdefault(k, []).append(rank)
    mine = None
    for k in sorted(members):  # the same order on every rank, as new_group requires
        group = dist.new_group(members[k], backend="gloo")
        if k == key:
            mine = group
    ranks = members[key]
    return _Group(group=mine, rank=ranks.index(dist.get_rank()), size=len(ranks))


def _even_bounds(rows: int, parts: int) -> list[int]:
    """Start offsets of `parts` contiguous slices of `rows` whose sizes differ by at most one."""
    base, extra = divmod(rows, parts)
    return _offsets([base + (i < extra) for i in range(parts)])


def _offsets(sizes: list[int]) -> list[int]:
    bounds = [0]
    for size in sizes:
        bounds.append(bounds[-1] + size)
    return bounds
