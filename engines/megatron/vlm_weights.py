"""Hugging Face LLaVA tensors <-> the Megatron-Core LLaVAModel of vlm.py, both ways, from one plan.

The language model's tensors follow weights.py's plan (`weight_plan`, its "vocab" / "qkv" /
"gate_up" / "row" / "replicated" layouts) under the prefixes `language_model.` on both sides. The
vision tower and projector add:
- "column" (ColumnParallelLinear: CLIP fc1 and projector linear_1, weight and bias): rows split over TP;
- "qkv" with one KV head per attention head: rows [q_h, k_h, v_h] per head h, TP rank r holding
  the r-th contiguous chunk (qkv_layout.py), for weights and biases;
- "row": input columns split, the row-parallel biases "replicated";
- "class_token": CLIP's class embedding, (h,) in HF and (1, 1, h) in Megatron, replicated.

HF names are those transformers 5 saves for `LlavaForConditionalGeneration` (`vision_tower.*`,
`multi_modal_projector.*`, `language_model.model.*`, `language_model.lm_head.weight`). Tensors that
LLaVA never reads (the tower's post_layernorm and the layers after `vision_feature_layer`) have no
Megatron parameter; export copies them unchanged from the source checkpoint, so a round trip
returns every tensor. Any other checkpoint name is refused on load, naming it.

Shapes: h vision hidden, H text hidden, f vision intermediate, P positions (patches + CLS).
"""

import json
import shutil
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from engines.megatron.config import MegatronConfig
from engines.megatron.model import padded_vocab_size
from engines.megatron.qkv_layout import qkv_row_sources, split_fused_qkv
from engines.megatron.vlm_config import VLMConfig
from engines.megatron.weights import (
    ModelLayout,
    SafetensorsReader,
    TensorPlan,
    copy_shard,
    gather_full,
    hf_shapes,
    read_shard,
    to_hf_tensors,
    weight_plan,
)

LM_PREFIX = "language_model."
VISION_HF, VISION_MEGATRON = "vision_tower.", "vision_model."
PROJECTOR_HF, PROJECTOR_MEGATRON = "multi_modal_projector.", "vision_projection.encoder."
SPLIT_KINDS = ("vocab", "qkv", "gate_up", "row", "column")


@dataclass(frozen=True)
class VLMPlan:
    """Every Megatron parameter of the LLaVA model once, and the HF tensors LLaVA never reads."""

    language: list[TensorPlan]
    vision: list[TensorPlan]  # tower and projector
    unused: list[TensorPlan]  # HF tensors LLaVA never reads, copied from the source on export


def language_plans(vlm: VLMConfig, tp: int, padded_vocab: int) -> list[TensorPlan]:
    """weights.py's plan of the text model, prefixed for LLaVA on both sides."""
    layout = ModelLayout(tp=tp, pp=1, padded_vocab=padded_vocab, value_head=False, fused_norms=False)
    return [
        replace(
            p, megatron_name=LM_PREFIX + p.megatron_name, hf_names=tuple(LM_PREFIX + n for n in p.hf_names)
        )
        for p in weight_plan(vlm.text, layout)
    ]


def _plan(
    megatron_name: str, kind: str, hf_names: tuple[str, ...], full_shape: tuple[int, ...]
) -> TensorPlan:
    return TensorPlan(megatron_name, kind, hf_names, full_shape, owner_pp=0)


def _vision_layer_plans(vlm: VLMConfig, i: int) -> list[TensorPlan]:
    h, f = vlm.vision.hidden_size, vlm.vision.intermediate_size
    m, p = f"{VISION_MEGATRON}decoder.layers.{i}.", f"{VISION_HF}encoder.layers.{i}."
    plans = []
    for suffix, shape in (("weight", (3 * h, h)), ("bias", (3 * h,))):
        qkv = tuple(f"{p}self_attn.{x}_proj.{suffix}" for x in "qkv")
        plans.append(_plan(f"{m}self_attention.linear_qkv.{suffix}", "qkv", qkv, shape))
    for megatron, hf, kind, shape in (
        ("input_layernorm.weight", "layer_norm1.weight", "replicated", (h,)),
        ("input_layernorm.bias", "layer_norm1.bias", "replicated", (h,)),
        ("self_attention.linear_proj.weight", "self_attn.out_proj.weight", "row", (h, h)),
        ("self_attention.linear_proj.bias", "self_attn.out_proj.bias", "replicated", (h,)),
        ("pre_mlp_layernorm.weight", "layer_norm2.weight", "replicated", (h,)),
        ("pre_mlp_layernorm.bias", "layer_norm2.bias", "replicated", (h,)),
        ("mlp.linear_fc1.weight", "mlp.fc1.weight", "column", (f, h)),
        ("mlp.linear_fc1.bias", "mlp.fc1.bias", "column", (f,)),
        ("mlp.linear_fc2.weight", "mlp.fc2.weight", "row", (h, f)),
        ("mlp.linear_fc2.bias", "mlp.fc2.bias", "replicated", (h,)),
    ):
        plans.append(_plan(m + megatron, kind, (p + hf,), shape))
    return plans


def _table(megatron_prefix: str, hf_prefix: str, rows) -> list[TensorPlan]:
    """Plans of one-tensor parameters from (Megatron name, HF name, kind, full shape) rows."""
    return [_plan(megatron_prefix + m, kind, (hf_prefix + hf,), shape) for m, hf, kind, shape in rows]


def vision_plans(vlm: VLMConfig) -> list[TensorPlan]:
    """The tower's embeddings and used layers, then the projector, in HF order."""
    v, text_h = vlm.vision, vlm.text.hidden_size
    h, patch, positions = v.hidden_size, v.patch_size, v.num_positions
    embeddings = _table(VISION_MEGATRON, VISION_HF, (
        ("class_token", "embeddings.class_embedding", "class_token", (1, 1, h)),
        ("conv1.weight", "embeddings.patch_embedding.weight", "replicated", (h, 3, patch, patch)),
        ("position_embeddings.weight", "embeddings.position_embedding.weight", "replicated", (positions, h)),
        ("ln_pre.weight", "pre_layrnorm.weight", "replicated", (h,)),
        ("ln_pre.bias", "pre_layrnorm.bias", "replicated", (h,)),
    ))  # fmt: skip
    layers = [p for i in range(vlm.vision_layers_used) for p in _vision_layer_plans(vlm, i)]
    projector = _table(PROJECTOR_MEGATRON, PROJECTOR_HF, (
        ("linear_fc1.weight", "linear_1.weight", "column", (text_h, h)),
        ("linear_fc1.bias", "linear_1.bias", "column", (text_h,)),
        ("linear_fc2.weight", "linear_2.weight", "row", (text_h, text_h)),
        ("linear_fc2.bias", "linear_2.bias", "replicated", (text_h,)),
    ))  # fmt: skip
    return [*embeddings, *layers, *projector]


def unused_plans(vlm: VLMConfig) -> list[TensorPlan]:
    """HF tensors LLaVA never reads (the layers after the feature layer, post_layernorm); their
    Megatron names name no parameter."""
    h = vlm.vision.hidden_size
    plans = [
        p for i in range(vlm.vision_layers_used, vlm.vision.num_layers) for p in _vision_layer_plans(vlm, i)
    ]
    return plans + [
        _plan("", "replicated", (f"{VISION_HF}post_layernorm.{x}",), (h,)) for x in ("weight", "bias")
    ]


def vlm_plan(vlm: VLMConfig, cfg: MegatronConfig, checkpoint_names) -> VLMPlan:
    """The plan for this config and TP size; ValueError naming any checkpoint tensor it does not place."""
    plan = VLMPlan(
        language=language_plans(
            vlm, cfg.tensor_model_parallel_size, padded_vocab_size(vlm.text.vocab_size, cfg)
        ),
        vision=vision_plans(vlm),
        unused=unused_plans(vlm),
    )
    placed = {n for p in plan.language + plan.vision + plan.unused for n in p.hf_names}
    unknown = sorted(set(checkpoint_names) - placed)
    if unknown:
        raise ValueError(
            f"{vlm.text.source_dir}: checkpoint tensors with no place in the LLaVA model: {unknown[:8]}"
        )
    return plan


# ---------------------------------------------------------------- loading


def _vision_hf_shapes(vlm: VLMConfig, plan: TensorPlan) -> list[tuple[int, ...]]:
    if plan.kind == "qkv":
        return [(plan.full_shape[0] // 3, *plan.full_shape[1:])] * 3
    if plan.kind == "class_token":
        return [(vlm.vision.hidden_size,)]
    return [plan.full_shape]


def read_vision_shard(
    reader: SafetensorsReader, vlm: VLMConfig, plan: TensorPlan, rank: int, tp: int
) -> torch.Tensor:
    """This TP rank's shard of a vision tower or projector parameter (reading only its slices)."""
    shapes = _vision_hf_shapes(vlm, plan)
    name, split = plan.hf_names[0], plan.full_shape[0] // tp
    if plan.kind in ("replicated", "class_token"):
        return reader.full(name, shapes[0]).reshape(plan.full_shape)
    if plan.kind == "column":
        return reader.rows(name, shapes[0], rank * split, (rank + 1) * split)
    if plan.kind == "row":
        cols = plan.full_shape[1] // tp
        return reader.cols(name, shapes[0], rank * cols, (rank + 1) * cols)
    segments = qkv_row_sources(rank * split, (rank + 1) * split, vlm.vision.num_heads, 1, vlm.vision.head_dim)
    return torch.cat([reader.rows(plan.hf_names[w], shapes[w], a, b) for w, a, b in segments])  # qkv


@torch.no_grad()
def load_vlm_weights(model, hf_dir, vlm: VLMConfig, cfg: MegatronConfig) -> None:
    """Copy this TP rank's slices of the HF LLaVA checkpoint at `hf_dir` into the LLaVAModel."""
    from megatron.core import parallel_state

    rank, tp = parallel_state.get_tensor_model_parallel_rank(), cfg.tensor_model_parallel_size
    with ExitStack() as stack:
        reader = SafetensorsReader(hf_dir, stack)
        plan = vlm_plan(vlm, cfg, reader.weight_map)
        for p in plan.language:
            copy_shard(model, p, read_shard(reader, vlm.text, p, rank, tp))
        for p in plan.vision:
            copy_shard(model, p, read_vision_shard(reader, vlm, p, rank, tp))


# ---------------------------------------------------------------- export


def _full_tensor(model, plan: TensorPlan, tp: int) -> torch.Tensor:
    """All TP shards of `plan`'s parameter in Megatron's full layout (collective over TP)."""
    from megatron.core import parallel_state

    local = model.get_parameter(plan.megatron_name)
    if plan.kind not in SPLIT_KINDS:
        return local.detach()
    return gather_full(local, plan, parallel_state.get_tensor_model_parallel_group(), tp)


def _vision_to_hf(full: torch.Tensor, plan: TensorPlan, vlm: VLMConfig) -> list[torch.Tensor]:
    if plan.kind == "qkv":
        return list(split_fused_qkv(full, vlm.vision.num_heads, 1, vlm.vision.head_dim))
    if plan.kind == "class_token":
        return [full.reshape(vlm.vision.hidden_size)]
    return [full]


def iter_vlm_hf_tensors(model, vlm: VLMConfig, cfg: MegatronConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, full contiguous tensor) of the whole LLaVA model on every TP rank, in lockstep
    (collective over TP): the language model, the vision tower and projector, then the unused HF
    tensors read from the source checkpoint (`vlm.text.source_dir`)."""
    tp = cfg.tensor_model_parallel_size
    with ExitStack() as stack:
        reader = SafetensorsReader(vlm.text.source_dir, stack)
        plan = vlm_plan(vlm, cfg, reader.weight_map)
        for p in plan.language:
            for name, tensor in zip(
                p.hf_names, to_hf_tensors(_full_tensor(model, p, tp), p, vlm.text, tp), strict=True
            ):
                yield name, tensor.clone(memory_format=torch.contiguous_format)
        for p in plan.vision:
            for name, tensor in zip(
                p.hf_names, _vision_to_hf(_full_tensor(model, p, tp), p, vlm), strict=True
            ):
                yield name, tensor.clone(memory_format=torch.contiguous_format)
        for p in plan.unused:
            for name, shape in zip(p.hf_names, _vision_hf_shapes(vlm, p), strict=True):
                yield name, reader.full(name, shape)


def vlm_stream_tensor_shapes(vlm: VLMConfig, cfg: MegatronConfig) -> dict[str, tuple[int, ...]]:
    """The (HF name, shape) pairs `iter_vlm_hf_tensors` yields, in its order, without moving a
    tensor (the checkpoint's header is read for the plan's check of its names)."""
    with ExitStack() as stack:
        plan = vlm_plan(vlm, cfg, SafetensorsReader(vlm.text.source_dir, stack).weight_map)
    shapes = {}
    for p in plan.language:
        shapes.update(zip(p.hf_names, hf_shapes(vlm.text, p), strict=True))
    for p in plan.vision + plan.unused:
        shapes.update(zip(p.hf_names, _vision_hf_shapes(vlm, p), strict=True))
    return {name: tuple(shape) for name, shape in shapes.items()}


def _copy_side_files(source: Path, out: Path, dtype: torch.dtype) -> None:
    """The source's tokenizer, processor and generation files, and its config.json with `dtype`."""
    for file in source.iterdir():
        if (
            file.is_file()
            and file.suffix in (".json", ".jinja", ".txt", ".model")
            and not file.name.startswith("model")
        ):
            shutil.copy2(file, out / file.name)
    config = json.loads((source / "config.json").read_text())
    config["dtype"] = str(dtype).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(config, indent=2))


def save_vlm_hf_checkpoint(model, vlm: VLMConfig, cfg: MegatronConfig, out_dir) -> None:
    """Write a transformers-loadable LLaVA directory (one model.safetensors, the source's config,
    tokenizer and processor files), replacing the weights of an earlier export there. Collective
    over TP; global rank 0 keeps the tensors and writes."""
    import torch.distributed as dist
    from safetensors.torch import save_file

    writer = dist.get_rank() == 0
    tensors = {name: t for name, t in iter_vlm_hf_tensors(model, vlm, cfg) if writer}
    if writer:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        for stale in out.glob("model*.safetensors*"):  # an earlier export's shards and index
            stale.unlink()
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        _copy_side_files(Path(vlm.text.source_dir), out, model.config.params_dtype)
    dist.barrier()
