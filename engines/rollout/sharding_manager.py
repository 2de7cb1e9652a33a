"""The hybrid engine's switch from training to generation: actor weights into the rollout engine,
and the batch reshaped between the actor's data-parallel layout and the rollout engines.

    sharding_manager.load_weights()                 # resume the weights' memory, sync the weights
    sharding_manager.start_generating()             # resume the KV cache, flush it
    piece = sharding_manager.preprocess_data(prompts)        # (any number of generation calls)
    out = engine.generate_sequences(piece) if engine is not None else None
    out = sharding_manager.postprocess_data(out)
    sharding_manager.release()                      # before the actor computes: the memory back

`with sharding_manager.generating():` is start_generating ... release around one block.

Engine memory (with `rollout.free_cache_engine`, the default). The engine's memory is released
as soon as the manager is built (the actor trains next), and comes back in two steps so that
the peak is the weights plus the actor, never the KV cache plus the actor plus buckets.
`load_weights`: `before_resume` hook (the actor's optimizer state and gradients to host memory,
the allocator's cache emptied) -> resume "weights" -> sync the weights -> `after_sync` hook (the
actor's parameters to host memory). `start_generating`: resume "kv_cache" and "cuda_graph" ->
flush the cache. `release` (the hybrid worker calls it before the actor's next computation)
releases everything (the weights too: the next generation needs `load_weights` again, and
`start_generating` refuses until then; `holds_weights` says which), then the `after_release` hook
brings the actor's state back. The manager tracks what is released and never resumes memory that
is not (SGLang's scheduler dies on that). With `free_cache_engine: false` nothing is ever released
or resumed: one `load_weights` serves any number of generations, which only flush.

Weights (`engines.weight_sync`, whose docstring says what is checked and when). The manager
holds the colocated sync (`ColocatedWeightSync`: the actor's HF-named stream into the engine in
memory, its names and shapes checked when the manager is built), or with `actor.lora.sync=adapters`
the adapter-only sync over it (`AdapterWeightSync`), and calls it in `load_weights`.

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

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch.distributed as dist

from engines.rollout.base import (
    CUDA_GRAPH_TAG,
    KV_CACHE_TAG,
    SEED_STREAM_KEY,
    WEIGHTS_TAG,
    RolloutEngine,
)
from engines.rollout.config import RolloutConfig
from engines.weight_sync.adapters import AdapterWeightSync, adapter_sync_config
from engines.weight_sync.colocated import ColocatedWeightSync, SyncStats
from hybridflow.protocol import DataProto, all_gather_data_proto

ALL_TAGS = [WEIGHTS_TAG, KV_CACHE_TAG, CUDA_GRAPH_TAG]


@dataclass
class OffloadHooks:
    """What the worker does around generation with the actor's own state (offload.py on GPU)."""

    before_resume: Callable[[], None] | None = None  # e.g. the optimizer state and gradients to host
    after_sync: Callable[[], None] | None = None  # e.g. the parameters to host (synced, unused now)
    after_release: Callable[[], None] | None = None  # e.g. bring it all back before the next update


@dataclass
class _Group:
    """One process group this rank belongs to, with its rank in it."""

    group: object
    rank: int
    size: int


class MegatronRolloutShardingManager:
    """`load_weights()`, then generation between `start_generating()` and `release()`; construct it
    on every rank at the same time (collective)."""

    def __init__(
        self,
        actor_chunks: list,
        hf_config,
        rollout_engine: RolloutEngine | None,
        rollout_cfg: RolloutConfig,
        offload_hooks: OffloadHooks | None = None,
    ):
        from megatron.core import parallel_state

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
        self.weights = _weight_sync(actor_chunks, hf_config, rollout_engine, rollout_cfg, self._rollout.group)
        self._slice_sizes: list[int] = []
        self._released: set[str] = set()
        self._holds_weights = False  # synced weights loaded since the engine last released them
        self._awake = False  # resumed since the last release (the actor's state may be offloaded)
        if self.engine is not None and rollout_cfg.free_cache_engine:
            self._release(ALL_TAGS)  # a new engine holds its memory; the actor trains first

    # ------------------------------------------------------------------ weights and memory
    def load_weights(self) -> SyncStats:
        """Bring the engine to the actor's weights (collective over all ranks), with the engine's
        weight memory resumed first and the offload hooks around; the stats are kept in `last_sync`."""
        if self.hooks.before_resume is not None:
            self.hooks.before_resume()
        self._resume([WEIGHTS_TAG])
        self._holds_weights = False  # until the sync succeeds: a failed one leaves a partial engine
        self._awake = True  # from here on `release` hands the memory back, even after a failure
        self.last_sync = self.weights.sync()
        self._holds_weights = True
        if self.hooks.after_sync is not None:
            self.hooks.after_sync()
        return self.last_sync

    @property
    def holds_weights(self) -> bool:
        """Synced weights are loaded and not released since (generation may start)."""
        return self._holds_weights

    def start_generating(self) -> None:
        """The engine ready to generate with the weights of the last `load_weights`: the KV cache
        resumed and flushed. It stays so, for any number of generation calls, until `release`."""
        if not self._holds_weights:
            raise RuntimeError(
                "start_generating() without weights: the engine released its memory (or was just "
                "built) and no load_weights() ran since; call load_weights() first"
            )
        self._resume([KV_CACHE_TAG, CUDA_GRAPH_TAG])
        if self.engine is not None:
            self.engine.flush_cache()
        self._awake = True

    def release(self) -> None:
        """The device back to the actor after `load_weights` / generation: the engine's memory
        released (with `free_cache_engine`: weights too) and `after_release` run; nothing when the
        engine is idle already."""
        if not self._awake:
            return
        if self.cfg.free_cache_engine:
            self._release(ALL_TAGS)
            self._holds_weights = False  # on every rank, engine or not, so that all refuse alike
        if self.hooks.after_release is not None:
            self.hooks.after_release()
        self._awake = False

    @contextmanager
    def generating(self) -> Iterator[None]:
        """`start_generating()`, the block, then `release()`."""
        self.start_generating()
        try:
            yield
        finally:
            self.release()

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


def _weight_sync(
    actor_chunks, hf_config, engine: RolloutEngine | None, cfg: RolloutConfig, rollout_group
) -> ColocatedWeightSync | AdapterWeightSync:
    """The adapter-only sync with `actor.lora.sync=adapters`, else the full stream (collective)."""
    stream = ColocatedWeightSync(actor_chunks, hf_config, engine, cfg, rollout_group)
    adapter_config = adapter_sync_config(actor_chunks, hf_config)
    return stream if adapter_config is None else AdapterWeightSync(stream, adapter_config)


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
