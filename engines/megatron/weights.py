"""The one mapping between Hugging Face tensors and Megatron-Core's sharded parameters
(Llama, Qwen2, Qwen3, Qwen3-MoE, Mixtral).

`weight_plan` lists every parameter of the whole model once, in HF order, with the pipeline stage
that owns it and how it is split over tensor-parallel ranks. Loading (`load_hf_weights`) and
export (`iter_hf_tensors`, `save_hf_checkpoint`) both walk this plan, so they cannot disagree.

Layouts (Megatron-Core 0.16, checked against its source):
- "vocab": rows split over TP; the vocabulary is padded to a multiple of
  make_vocab_size_divisible_by x TP, padded rows are zero on load and dropped on export.
- "row" (RowParallelLinear: o_proj, down_proj): input columns split over TP.
- "qkv": the fused QKV rows are grouped per KV head, [q heads of group g, k_g, v_g] for each g,
  and TP rank r holds the r-th contiguous chunk of that layout (qkv_layout.py). When TP exceeds
  the KV head count, a chunk is a part of one group (Megatron all-gathers and re-slices in attention).
- "gate_up": TP rank r holds [gate rows of r; up rows of r] (split with chunk(2) in the MLP).
- "replicated": norms, QK norms, the MoE router (and the value head) are whole on every TP rank.
- Experts (`expert=True`): expert e lives on expert-parallel rank e // (E / EP) as its local
  expert e % (E / EP), with "gate_up" / "row" splits over the expert-tensor-parallel group.
  HF names are the per-expert ones transformers saves and SGLang loads
  (`mlp.experts.{e}.gate_proj` for Qwen3-MoE, `block_sparse_moe.experts.{e}.w1` for Mixtral).

Shapes: h hidden, V real vocab, Vp padded vocab, f intermediate, d head dim.
"""

import json
import shutil
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from engines.megatron.model import HFModelConfig, padded_vocab_size, unwrap_model, use_transformer_engine
from engines.megatron.qkv_layout import qkv_row_sources, split_fused_qkv
from engines.megatron.tp_staging import Split, TPStaging

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "generation_config.json",
)


@dataclass(frozen=True)
class TensorPlan:
    """One Megatron parameter: where it lives, how it is split, which HF tensors it holds."""

    megatron_name: str  # parameter path inside the owning stage's GPTModel
    kind: str  # "replicated" | "vocab" | "row" | "qkv" | "gate_up"
    hf_names: tuple[str, ...]
    full_shape: tuple[int, ...]  # Megatron layout, all TP shards concatenated, vocab padded
    owner_pp: int
    expert: bool = False  # split over expert-TP (not TP), held by one expert-parallel rank
    owner_ep: int = 0


@dataclass(frozen=True)
class ModelLayout:
    """What the plan depends on besides the HF config."""

    tp: int
    pp: int
    padded_vocab: int
    value_head: bool
    fused_norms: bool  # Transformer Engine layers hold the norms inside linear_qkv / linear_fc1
    ep: int = 1
    etp: int = 1
    grouped_experts: bool = False  # TE grouped GEMM: experts.linear_fc1.weight{j}


# HF checkpoint names of one MoE layer: router, then expert e's (gate, up, down) projections.
MOE_HF_NAMES = {
    "qwen3_moe": ("mlp.gate.weight", "mlp.experts.{e}.{w}.weight", ("gate_proj", "up_proj", "down_proj")),
    "mixtral": (
        "block_sparse_moe.gate.weight",
        "block_sparse_moe.experts.{e}.{w}.weight",
        ("w1", "w3", "w2"),
    ),
}


def _expert_plans(hf: HFModelConfig, layout: ModelLayout, m: str, p: str, stage: int) -> list[TensorPlan]:
    router, expert_name, (gate, up, down) = MOE_HF_NAMES[hf.model_type]
    h, f, per_rank = hf.hidden_size, hf.moe_ffn_hidden_size, hf.num_experts // layout.ep
    plans = [TensorPlan(m + "mlp.router.weight", "replicated", (p + router,), (hf.num_experts, h), stage)]
    for e in range(hf.num_experts):
        owner, j = divmod(e, per_rank)
        if layout.grouped_experts:
            fc1, fc2 = f"mlp.experts.linear_fc1.weight{j}", f"mlp.experts.linear_fc2.weight{j}"
        else:
            fc1, fc2 = (f"mlp.experts.local_experts.{j}.linear_fc{i}.weight" for i in (1, 2))
        names = [p + expert_name.format(e=e, w=w) for w in (gate, up, down)]
        plans += [
            TensorPlan(m + fc1, "gate_up", tuple(names[:2]), (2 * f, h), stage, True, owner),
            TensorPlan(m + fc2, "row", (names[2],), (h, f), stage, True, owner),
        ]
    return plans


def _layer_plan(hf: HFModelConfig, layout: ModelLayout, g: int) -> list[TensorPlan]:
    per_stage = hf.num_hidden_layers // layout.pp
    stage, i = divmod(g, per_stage)
    m, p = f"decoder.layers.{i}.", f"model.layers.{g}."
    h, d, f = hf.hidden_size, hf.head_dim, hf.intermediate_size
    qkv_rows = (hf.num_attention_heads + 2 * hf.num_key_value_heads) * d
    qkv_names = tuple(f"{p}self_attn.{x}_proj.weight" for x in "qkv")
    if layout.fused_norms and not hf.num_experts:
        input_norm, post_norm = (
            "self_attention.linear_qkv.layer_norm_weight",
            "mlp.linear_fc1.layer_norm_weight",
        )
    elif layout.fused_norms:  # TE's MoE layers keep a separate pre-MLP norm
        input_norm, post_norm = "self_attention.linear_qkv.layer_norm_weight", "pre_mlp_layernorm.weight"
    else:
        input_norm, post_norm = "input_layernorm.weight", "pre_mlp_layernorm.weight"
    plans = [
        TensorPlan(m + input_norm, "replicated", (p + "input_layernorm.weight",), (h,), stage),
        TensorPlan(m + "self_attention.linear_qkv.weight", "qkv", qkv_names, (qkv_rows, h), stage),
    ]
    if hf.qkv_bias:
        bias_names = tuple(n.replace(".weight", ".bias") for n in qkv_names)
        plans.append(TensorPlan(m + "self_attention.linear_qkv.bias", "qkv", bias_names, (qkv_rows,), stage))
    plans += [
        TensorPlan(
            m + "self_attention.linear_proj.weight",
            "row",
            (p + "self_attn.o_proj.weight",),
            (h, hf.num_attention_heads * d),
            stage,
        ),
    ]
    if hf.qk_layernorm:
        plans += [
            TensorPlan(
                m + f"self_attention.{x}_layernorm.weight",
                "replicated",
                (p + f"self_attn.{x}_norm.weight",),
                (d,),
                stage,
            )
            for x in "qk"
        ]
    plans.append(
        TensorPlan(m + post_norm, "replicated", (p + "post_attention_layernorm.weight",), (h,), stage)
    )
    if hf.num_experts:
        return plans + _expert_plans(hf, layout, m, p, stage)
    plans += [
        TensorPlan(
            m + "mlp.linear_fc1.weight",
            "gate_up",
            (p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"),
            (2 * f, h),
            stage,
        ),
        TensorPlan(m + "mlp.linear_fc2.weight", "row", (p + "mlp.down_proj.weight",), (h, f), stage),
    ]
    return plans


def weight_plan(hf: HFModelConfig, layout: ModelLayout) -> list[TensorPlan]:
    """Every parameter of the model once, in HF order (embedding, layers 0.., norm, head)."""
    h, last = hf.hidden_size, layout.pp - 1
    plans = [
        TensorPlan(
            "embedding.word_embeddings.weight",
            "vocab",
            ("model.embed_tokens.weight",),
            (layout.padded_vocab, h),
            0,
        )
    ]
    for g in range(hf.num_hidden_layers):
        plans += _layer_plan(hf, layout, g)
    plans.append(
        TensorPlan("decoder.final_layernorm.weight", "replicated", ("model.norm.weight",), (h,), last)
    )
    if layout.value_head:
        plans.append(TensorPlan("output_layer.weight", "replicated", ("score.weight",), (1, h), last))
    elif not hf.tie_word_embeddings:
        plans.append(
            TensorPlan("output_layer.weight", "vocab", ("lm_head.weight",), (layout.padded_vocab, h), last)
        )
    return plans


def model_layout(model) -> ModelLayout:
    """The layout of a GPTModel built by `build_model` (which attaches its configs)."""
    from megatron.core import parallel_state

    return ModelLayout(
        tp=parallel_state.get_tensor_model_parallel_world_size(),
        pp=parallel_state.get_pipeline_model_parallel_world_size(),
        padded_vocab=padded_vocab_size(model.hf_config.vocab_size, model.megatron_config),
        value_head=model.value_head,
        fused_norms=use_transformer_engine(),
        ep=parallel_state.get_expert_model_parallel_world_size(),
        etp=parallel_state.get_expert_tensor_parallel_world_size(),
        grouped_experts=use_transformer_engine() and bool(model.hf_config.num_experts),
    )


def _split_ranks(plan: TensorPlan, layout: ModelLayout, tp_rank: int, etp_rank: int) -> tuple[int, int]:
    """(rank, size) of the group `plan`'s parameter is split over: expert-TP for experts, else TP."""
    return (etp_rank, layout.etp) if plan.expert else (tp_rank, layout.tp)


# ---------------------------------------------------------------- loading


class SafetensorsReader:
    """Reads whole tensors or row/column slices from a HF directory's safetensors shards."""

    def __init__(self, hf_dir, stack: ExitStack):
        from safetensors import safe_open

        self.hf_dir = Path(hf_dir)
        index_file = self.hf_dir / "model.safetensors.index.json"
        if index_file.is_file():
            weight_map = json.loads(index_file.read_text())["weight_map"]
        elif (self.hf_dir / "model.safetensors").is_file():
            with safe_open(self.hf_dir / "model.safetensors", framework="pt") as f:
                weight_map = dict.fromkeys(f.keys(), "model.safetensors")
        else:
            raise ValueError(f"{hf_dir}: neither model.safetensors.index.json nor model.safetensors found")
        self.weight_map = weight_map
        self._stack, self._open, self._safe_open = stack, {}, safe_open

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def _slice(self, name: str, expected_shape: tuple[int, ...]):
        if name not in self.weight_map:
            raise ValueError(f"{self.hf_dir}: tensor {name!r} is missing from the checkpoint")
        file = self.weight_map[name]
        if file not in self._open:
            self._open[file] = self._stack.enter_context(
                self._safe_open(self.hf_dir / file, framework="pt", device="cpu")
            )
        tensor_slice = self._open[file].get_slice(name)
        shape = tuple(tensor_slice.get_shape())
        if shape != expected_shape:
            raise ValueError(f"{self.hf_dir}: tensor {name!r} has shape {shape}, expected {expected_shape}")
        return tensor_slice

    def rows(self, name: str, expected_shape: tuple[int, ...], start: int, end: int) -> torch.Tensor:
        return self._slice(name, expected_shape)[start:end]

    def cols(self, name: str, expected_shape: tuple[int, ...], start: int, end: int) -> torch.Tensor:
        return self._slice(name, expected_shape)[:, start:end]

    def full(self, name: str, expected_shape: tuple[int, ...]) -> torch.Tensor:
        return self._slice(name, expected_shape)[:]


def hf_shapes(hf: HFModelConfig, plan: TensorPlan) -> list[tuple[int, ...]]:
    """Shapes of the plan's HF tensors."""
    if plan.kind == "vocab":
        return [(hf.vocab_size, *plan.full_shape[1:])]
    if plan.kind == "qkv":
        d, rest = hf.head_dim, plan.full_shape[1:]
        return [
            (hf.num_attention_heads * d, *rest),
            (hf.num_key_value_heads * d, *rest),
            (hf.num_key_value_heads * d, *rest),
        ]
    if plan.kind == "gate_up":
        return [(plan.full_shape[0] // 2, plan.full_shape[1])] * 2
    return [plan.full_shape]


def hf_tensor_shapes(hf: HFModelConfig, value_head: bool = False) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor `load_hf_weights` reads from a Hugging Face checkpoint of this
    config (the causal-LM head, or with `value_head` the score head), from the same plan."""
    layout = ModelLayout(tp=1, pp=1, padded_vocab=hf.vocab_size, value_head=value_head, fused_norms=False)
    return {
        name: shape
        for plan in weight_plan(hf, layout)
        for name, shape in zip(plan.hf_names, hf_shapes(hf, plan), strict=True)
    }


def read_shard(
    reader: SafetensorsReader, hf: HFModelConfig, plan: TensorPlan, rank: int, tp: int
) -> torch.Tensor:
    """This TP rank's shard of `plan`'s parameter, reading only the needed slices."""
    shapes = hf_shapes(hf, plan)
    if plan.kind == "replicated":
        return reader.full(plan.hf_names[0], shapes[0])
    if plan.kind == "vocab":
        rows = plan.full_shape[0] // tp
        start, end = rank * rows, (rank + 1) * rows
        shard = torch.zeros(rows, *plan.full_shape[1:])  # padded rows stay zero
        real_end = min(end, hf.vocab_size)
        if real_end > start:
            real = reader.rows(plan.hf_names[0], shapes[0], start, real_end)
            shard = shard.to(real.dtype)
            shard[: real_end - start] = real
        return shard
    if plan.kind == "row":
        cols = plan.full_shape[1] // tp
        return reader.cols(plan.hf_names[0], shapes[0], rank * cols, (rank + 1) * cols)
    if plan.kind == "gate_up":
        rows = plan.full_shape[0] // 2 // tp
        gate, up = (
            reader.rows(n, s, rank * rows, (rank + 1) * rows)
            for n, s in zip(plan.hf_names, shapes, strict=True)
        )
        return torch.cat([gate, up])
    if plan.kind == "qkv":
        rows = plan.full_shape[0] // tp
        groups = hf.num_key_value_heads
        segments = qkv_row_sources(
            rank * rows, (rank + 1) * rows, groups, hf.num_attention_heads // groups, hf.head_dim
        )
        return torch.cat([reader.rows(plan.hf_names[w], shapes[w], a, b) for w, a, b in segments])
    raise ValueError(f"unknown tensor kind {plan.kind!r}")


def _check_layer_numbers(model, hf: HFModelConfig, layout: ModelLayout, pp_rank: int) -> None:
    per_stage = hf.num_hidden_layers // layout.pp
    for i, layer in enumerate(model.decoder.layers):
        if layer.layer_number != pp_rank * per_stage + i + 1:
            raise RuntimeError(
                f"pipeline stage {pp_rank} layer {i} has global number {layer.layer_number}, expected "
                f"{pp_rank * per_stage + i + 1} (only even layer splits are supported)"
            )


def _load_plans(hf: HFModelConfig, layout: ModelLayout, pp_rank: int, ep_rank: int) -> list[TensorPlan]:
    plans = [
        p
        for p in weight_plan(hf, layout)
        if p.owner_pp == pp_rank and (not p.expert or p.owner_ep == ep_rank)
    ]
    if hf.tie_word_embeddings and not layout.value_head and layout.pp > 1 and pp_rank == layout.pp - 1:
        # The last stage keeps its own copy of the tied embedding as the output layer.
        plans.append(
            TensorPlan(
                "output_layer.weight",
                "vocab",
                ("model.embed_tokens.weight",),
                (layout.padded_vocab, hf.hidden_size),
                pp_rank,
            )
        )
    return plans


@torch.no_grad()
def load_hf_weights(chunks, hf_dir, hf_config: HFModelConfig) -> None:
    """Copy this rank's slices of the HF checkpoint at `hf_dir` into the model chunks."""
    from megatron.core import parallel_state

    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    ep_rank = parallel_state.get_expert_model_parallel_rank()
    etp_rank = parallel_state.get_expert_tensor_parallel_rank()
    with ExitStack() as stack:
        reader = SafetensorsReader(hf_dir, stack)
        for chunk in chunks:
            model = unwrap_model(chunk)
            layout = model_layout(model)
            _check_layer_numbers(model, hf_config, layout, pp_rank)
            for plan in _load_plans(hf_config, layout, pp_rank, ep_rank):
                if layout.value_head and plan.hf_names == ("score.weight",) and "score.weight" not in reader:
                    continue  # a fresh value head on a causal-LM checkpoint keeps its initialisation
                shard = read_shard(reader, hf_config, plan, *_split_ranks(plan, layout, tp_rank, etp_rank))
                copy_shard(model, plan, shard)


def copy_shard(model, plan: TensorPlan, shard: torch.Tensor) -> None:
    """`shard` into `plan`'s parameter of `model`; a RuntimeError when the shapes differ."""
    param = model.get_parameter(plan.megatron_name)
    if shard.shape != param.shape:
        raise RuntimeError(
            f"{plan.megatron_name}: shard shape {tuple(shard.shape)} != parameter shape {tuple(param.shape)}"
        )
    param.copy_(shard)


# ---------------------------------------------------------------- export


def _split_dim(plan: TensorPlan) -> int:
    """The dimension `plan`'s parameter is split along over TP ranks."""
    return 1 if plan.kind == "row" else 0


def gather_full(local: torch.Tensor, plan: TensorPlan, tp_group, tp: int) -> torch.Tensor:
    """All TP shards of `plan` concatenated along the split dimension (the Megatron full layout)."""
    if plan.kind == "replicated" or tp == 1:
        return local.detach()
    shards = [torch.empty_like(local) for _ in range(tp)]
    dist.all_gather(shards, local.detach().contiguous(), group=tp_group)
    return torch.cat(shards, dim=_split_dim(plan))


def _staged_shards(model, hf_config: HFModelConfig) -> tuple[dict[str, torch.Tensor], dict[str, Split]]:
    """This rank's TP shard of every TP-split parameter its pipeline stage owns (experts, split over
    expert-TP, excluded), by Megatron name, with how each is split."""
    from megatron.core import parallel_state

    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    plans = [
        plan
        for plan in weight_plan(hf_config, model_layout(model))
        if plan.owner_pp == pp_rank and not plan.expert and plan.kind != "replicated"
    ]
    shards = {plan.megatron_name: model.get_parameter(plan.megatron_name) for plan in plans}
    return shards, {
        plan.megatron_name: Split(_split_dim(plan), 2 if plan.kind == "gate_up" else 1) for plan in plans
    }


def _gather_stage_tensor(
    model, plan: TensorPlan, staging: TPStaging | None, tp_group, tp: int
) -> torch.Tensor:
    """The full tensor of a non-expert parameter this rank's pipeline stage owns."""
    if staging is not None and plan.megatron_name in staging:
        return staging.full(plan.megatron_name)
    return gather_full(model.get_parameter(plan.megatron_name), plan, tp_group, tp)


def tp_staging(chunks, hf_config: HFModelConfig) -> TPStaging | None:
    """The shared-memory TP gather for `iter_hf_tensors(..., staging=)` (tp_staging.py), or None
    where it does not apply (TP 1, CUDA, ranks on different hosts). Collective over the TP group."""
    from megatron.core import parallel_state

    shards, splits = _staged_shards(unwrap_model(chunks[0]), hf_config)
    return TPStaging.create(shards, splits, parallel_state.get_tensor_model_parallel_group())


def _gather_expert(model, plan: TensorPlan, layout: ModelLayout, ep_rank: int, dtype, device) -> torch.Tensor:
    """The whole expert tensor on every rank of its stage: expert-TP gather on the owner, EP broadcast."""
    from megatron.core import parallel_state

    if ep_rank == plan.owner_ep:
        etp_group = parallel_state.get_expert_tensor_parallel_group()
        full = gather_full(model.get_parameter(plan.megatron_name), plan, etp_group, layout.etp).contiguous()
    else:
        full = torch.empty(plan.full_shape, dtype=dtype, device=device)
    if layout.ep > 1:
        ep_group = parallel_state.get_expert_model_parallel_group()
        dist.broadcast(full, group=ep_group, group_src=plan.owner_ep)
    return full


def to_hf_tensors(full: torch.Tensor, plan: TensorPlan, hf: HFModelConfig, tp: int) -> list[torch.Tensor]:
    if plan.kind == "vocab":
        return [full[: hf.vocab_size]]
    if plan.kind == "gate_up":
        # Megatron's [gate_r; up_r] of each rank r -> HF's [gate; up]: views at TP 1 and of the TP
        # staging's buffer (which holds HF's order), one copy of a plain gathered tensor.
        rest = plan.full_shape[1:]
        return list(full.reshape(tp, 2, -1, *rest).transpose(0, 1).reshape(2, -1, *rest).unbind())
    if plan.kind == "qkv":
        groups = hf.num_key_value_heads
        return list(split_fused_qkv(full, groups, hf.num_attention_heads // groups, hf.head_dim))
    return [full]


def stream_tensor_shapes(chunks, hf_config: HFModelConfig) -> dict[str, tuple[int, ...]]:
    """The (HF name, shape) pairs `iter_hf_tensors` yields, in its order, without moving a tensor."""
    layout = model_layout(unwrap_model(chunks[0]))
    return {
        name: tuple(shape)
        for plan in weight_plan(hf_config, layout)
        for name, shape in zip(plan.hf_names, hf_shapes(hf_config, plan), strict=True)
    }


def iter_hf_tensors(
    chunks, hf_config: HFModelConfig, copies: bool = True, staging: TPStaging | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, full tensor) for the whole model on every rank, in lockstep.

    Collective: every rank of the model-parallel group must iterate to the end together. The
    owning pipeline stage all-gathers each parameter over its TP group, then broadcasts it over
    the pipeline group; an expert's owning expert-parallel rank all-gathers it over its expert-TP
    group and broadcasts it over the expert-parallel group first. Tensors are contiguous, in the
    parameter dtype, vocab padding removed, fused QKV and gate/up split; `lm_head.weight` only
    when embeddings are untied. They are copies; with `copies=False` those that needed no gather
    or reordering are views of the actor's parameters, for a consumer that copies what it reads
    before the actor's next update and never writes to it. With LoRA adapters (lora.py) the
    adapted tensors are merged, base + scale * B @ A, so every engine receives plain HF tensors.

    With `staging` (`tp_staging(chunks, hf_config)`, kept by the caller across streams) the TP
    gather goes through shared memory instead of one collective per tensor: every rank writes its
    shards into the staging buffer when the stream starts, and with `copies=False` the gathered
    tensors are views of that buffer, valid until the next stream over it starts.
    """
    from megatron.core import parallel_state

    from engines.megatron.lora import lora_merger

    merge = lora_merger(chunks)
    model = unwrap_model(chunks[0])
    layout = model_layout(model)
    tp_group = parallel_state.get_tensor_model_parallel_group()
    pp_group = parallel_state.get_pipeline_model_parallel_group()
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    ep_rank = parallel_state.get_expert_model_parallel_rank()
    dtype = model.config.params_dtype
    device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    if staging is not None:
        staging.fill(_staged_shards(model, hf_config)[0])
    for plan in weight_plan(hf_config, layout):
        if plan.owner_pp == pp_rank and plan.expert:
            full = _gather_expert(model, plan, layout, ep_rank, dtype, device)
        elif plan.owner_pp == pp_rank:  # (megatron names repeat across stages: the owner first)
            full = _gather_stage_tensor(model, plan, staging, tp_group, layout.tp)
        else:
            full = torch.empty(plan.full_shape, dtype=dtype, device=device)
        if layout.pp > 1:
            full = full.reshape(plan.full_shape).contiguous()  # (a staged gate/up is 4-d: tp_staging.py)
            dist.broadcast(full, group=pp_group, group_src=plan.owner_pp)
        split = layout.etp if plan.expert else layout.tp
        for name, tensor in zip(plan.hf_names, to_hf_tensors(full, plan, hf_config, split), strict=True):
            tensor = merge(name, tensor) if merge else tensor
            yield name, tensor.clone(memory_format=torch.contiguous_format) if copies else tensor.contiguous()


def hf_export_config(hf_config: HFModelConfig, dtype: torch.dtype, value_head: bool) -> dict:
    """config.json of the exported model: the source's, with dtype (and head) updated."""
    config = dict(hf_config.raw)
    dtype_key = "dtype" if "dtype" in config else "torch_dtype"  # transformers 5 writes "dtype"
    config[dtype_key] = str(dtype).removeprefix("torch.")
    if value_head:
        family = hf_config.architecture.split("For")[0]
        config["architectures"] = [f"{family}ForSequenceClassification"]
        config["num_labels"] = 1
        config["tie_word_embeddings"] = False
    return config


def _write_shard(out: Path, shard: dict[str, torch.Tensor], number: int) -> tuple[Path, dict[str, int]]:
    from safetensors.torch import save_file

    path = out / f"tmp-shard-{number:05d}.safetensors"
    save_file(shard, str(path), metadata={"format": "pt"})
    return path, {name: t.numel() * t.element_size() for name, t in shard.items()}


def _finish_export(out: Path, written: list, hf_config: HFModelConfig, model, tokenizer_dir) -> None:
    """Name the shards model-0000i-of-0000n, write the index, config.json and tokenizer files."""
    weight_map, total = {}, 0
    for i, (path, sizes) in enumerate(written, start=1):
        file = f"model-{i:05d}-of-{len(written):05d}.safetensors"
        path.rename(out / file)
        weight_map.update(dict.fromkeys(sizes, file))
        total += sum(sizes.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    config = hf_export_config(hf_config, model.config.params_dtype, model.value_head)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    source = Path(tokenizer_dir or hf_config.source_dir)
    for file in TOKENIZER_FILES:
        if (source / file).is_file():
            shutil.copy2(source / file, out / file)


def save_hf_checkpoint(
    chunks, hf_config: HFModelConfig, out_dir, tokenizer_dir=None, max_shard_bytes: int = 5 * 2**30
) -> None:
    """Write a transformers-loadable directory: sharded safetensors + index, config, tokenizer files.

    Collective (see `iter_hf_tensors`); global rank 0 writes, one shard at a time, replacing the
    safetensors of an earlier export in `out_dir`. Tokenizer files are copied from
    `tokenizer_dir` (default: the directory the model was loaded from).
    """
    writer = dist.get_rank() == 0
    out = Path(out_dir)
    if writer:
        out.mkdir(parents=True, exist_ok=True)
        for stale in [*out.glob("model*.safetensors"), *out.glob("tmp-shard-*.safetensors")]:
            stale.unlink()
    shard, shard_bytes, written = {}, 0, []
    for name, tensor in iter_hf_tensors(chunks, hf_config):
        if not writer:
            continue
        size = tensor.numel() * tensor.element_size()
        if shard and shard_bytes + size > max_shard_bytes:
            written.append(_write_shard(out, shard, len(written)))
            shard, shard_bytes = {}, 0
        shard[name] = tensor
        shard_bytes += size
    if writer:
        written.append(_write_shard(out, shard, len(written)))
        _finish_export(out, written, hf_config, unwrap_model(chunks[0]), tokenizer_dir)
    dist.barrier()
