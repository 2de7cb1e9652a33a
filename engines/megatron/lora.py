"""LoRA adapters on Megatron-Core's tensor-parallel linears, exactly equivalent to peft's adapters
on the Hugging Face projections (docs/lora.md).

`attach_lora(model, lora)` freezes every base parameter of a GPTModel built by `build_model` and
puts an adapter (`LoraAdapter`, the child `lora` of the linear) plus a forward hook on each
targeted linear; the hook adds `alpha / rank * B A dropout(x)` to the linear's output. Parameter
names of the base model do not change, so the weight plan (weights.py) is untouched.

One adapter per Hugging Face projection, as peft puts them: Megatron fuses q/k/v into linear_qkv
(rows grouped per KV head, qkv_layout.py) and gate/up into linear_fc1, so a fused linear holds one
(A, B) pair per part (`lora_A.q_proj`, `lora_B.q_proj`, ...) and lays the parts' outputs out in
the fused order. A single (A, B) over the fused output would be a different (rank-r, not rank-3r
per part) function and could not be exported to peft.

Sharding over tensor-parallel (TP) ranks, like the base weight:
- column-parallel (linear_qkv, linear_fc1; output rows split): A (r, in) whole on every rank;
  B holds the rows of this rank's output slice. `a = A x` is passed through Megatron's
  copy-to-TP region so its gradient (and A's) sums every rank's output rows.
- row-parallel (linear_proj, linear_fc2; input columns split): A holds this rank's input
  columns, the partial products `A_r x_r` are all-reduced (reduce-from-TP region) before B,
  which is whole on every rank: the sum over ranks is `A x`.
Whole-on-every-rank tensors are marked as tensor-parallel duplicates (Megatron's
`tensor_model_parallel=False`), so the grad norm counts them once.

Initial values do not depend on the layout: each adapter tensor is drawn whole from a generator
seeded by `lora.seed` and the tensor's name, then sliced. A is peft's default (kaiming-uniform with
a=sqrt(5): U(-1/sqrt(in), 1/sqrt(in))), B is zero, so step 0 is the base model.

Dropout draws one mask over the whole input width (the same on every TP rank, whose default
generators agree) and row-parallel ranks keep their columns of it.

Also here: the merged weight stream (`lora_merger`, used by weights.iter_hf_tensors), peft
export (`iter_lora_tensors`, `save_peft_adapter`), adapters in Megatron's distributed checkpoints
(`_sharded_state_dict_with_adapter`), `parameter_counts`.

Not supported yet (refused by `validate_lora_layout`): Transformer Engine's fused-norm linears
(CUDA), sequence parallelism, adapters on mixture-of-experts MLPs.

Shapes: s sequence, b batch, r rank, P parts of a fused linear.
"""

import hashlib
import json
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from engines.megatron.config import LoraConfig, MegatronConfig
from engines.megatron.model import HFModelConfig, unwrap_model
from engines.megatron.qkv_layout import qkv_row_sources

# Megatron-Core module (inside a decoder layer) -> its parallel style and the HF projections it holds.
TARGETS = {
    "linear_qkv": ("self_attention.linear_qkv", "column", tuple(f"self_attn.{x}_proj" for x in "qkv")),
    "linear_proj": ("self_attention.linear_proj", "row", ("self_attn.o_proj",)),
    "linear_fc1": ("mlp.linear_fc1", "column", ("mlp.gate_proj", "mlp.up_proj")),
    "linear_fc2": ("mlp.linear_fc2", "row", ("mlp.down_proj",)),
}  # fmt: skip
PEFT_PREFIX = "base_model.model."  # peft's state-dict names: this + the HF module name


@dataclass(frozen=True)
class AdapterLayout:
    """Where one targeted linear's adapter tensors live on one TP rank (a plain value)."""

    target: str  # a key of TARGETS
    parallel: str  # "column" | "row"
    parts: tuple[str, ...]  # HF projections (peft adapters), e.g. ("self_attn.q_proj", ...)
    shapes: tuple[tuple[int, int], ...]  # each part's HF weight shape (out, in)
    # column: this rank's output rows in local order as (part index, first, end) rows of that part
    segments: tuple[tuple[int, int, int], ...] = ()
    columns: tuple[int, int] = (0, 0)  # row: this rank's input columns [first, end)

    def a_shape(self, part: int, rank: int) -> tuple[int, int]:
        first, end = self.columns
        return (rank, end - first) if self.parallel == "row" else (rank, self.shapes[part][1])

    def b_rows(self, part: int) -> list[tuple[int, int]]:
        """The rows of part `part`'s B held here, [(first, end), ...] in local order (none when TP
        exceeds the KV heads and this rank's slice of the fused QKV holds no k or no v)."""
        if self.parallel == "row":
            return [(0, self.shapes[part][0])]
        return [(first, end) for p, first, end in self.segments if p == part]

    def b_index(self, part: int) -> torch.Tensor:
        """`b_rows` as a row index into the whole B, (rows_local,)."""
        return torch.tensor(
            [row for first, end in self.b_rows(part) for row in range(first, end)], dtype=torch.long
        )


def _part_shapes(hf: HFModelConfig, target: str) -> tuple[tuple[int, int], ...]:
    h, d, f = hf.hidden_size, hf.head_dim, hf.intermediate_size
    q, kv = hf.num_attention_heads * d, hf.num_key_value_heads * d
    return {
        "linear_qkv": ((q, h), (kv, h), (kv, h)),
        "linear_proj": ((h, q),),
        "linear_fc1": ((f, h), (f, h)),
        "linear_fc2": ((h, f),),
    }[target]


def adapter_layout(hf: HFModelConfig, target: str, tp_rank: int, tp: int) -> AdapterLayout:
    """The adapter layout of `target` on TP rank `tp_rank` of `tp`, following the base weight's
    split (weights.py: fused QKV rows grouped per KV head, [gate_r; up_r] for linear_fc1)."""
    _, parallel, parts = TARGETS[target]
    shapes = _part_shapes(hf, target)
    if parallel == "row":
        width = shapes[0][1] // tp
        return AdapterLayout(
            target, parallel, parts, shapes, columns=(tp_rank * width, (tp_rank + 1) * width)
        )
    if target == "linear_fc1":
        rows = shapes[0][0] // tp
        first, end = tp_rank * rows, (tp_rank + 1) * rows
        return AdapterLayout(target, parallel, parts, shapes, segments=((0, first, end), (1, first, end)))
    fused_rows = sum(out for out, _ in shapes) // tp
    groups = hf.num_key_value_heads
    segments = qkv_row_sources(
        tp_rank * fused_rows,
        (tp_rank + 1) * fused_rows,
        groups,
        hf.num_attention_heads // groups,
        hf.head_dim,
    )
    return AdapterLayout(target, parallel, parts, shapes, segments=tuple(segments))


def validate_lora_layout(
    hf: HFModelConfig, cfg: MegatronConfig, lora: LoraConfig, transformer_engine: bool
) -> None:
    """ValueError naming the setting when adapters cannot be put on this model and layout."""
    if not lora.rank:
        return
    if transformer_engine:
        raise ValueError(
            "actor.lora: adapters on Transformer Engine's fused-norm linears are not supported yet; "
            "LoRA runs with Megatron-Core's local layers (machines without Transformer Engine)"
        )
    if cfg.sequence_parallel:
        raise ValueError(
            "actor.lora with megatron.sequence_parallel=true is not supported yet; set it to false"
        )
    mlp = [t for t in lora.target_modules if t in ("linear_fc1", "linear_fc2")]
    if hf.num_experts and mlp:
        raise ValueError(
            f"actor.lora.target_modules {mlp}: adapters on mixture-of-experts MLPs ({hf.architecture}) "
            "are not supported yet; target linear_qkv and linear_proj only"
        )


# ---------------------------------------------------------------- the adapter module


def _mark_tensor_parallel(param: torch.nn.Parameter, split_dim: int | None) -> None:
    """Megatron's TP attributes: split along `split_dim`, or None for a duplicate on every rank."""
    from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes

    set_tensor_model_parallel_attributes(param, split_dim is not None, split_dim or 0, 1)


class LoraAdapter(torch.nn.Module):
    """`alpha / rank * B A dropout(x)` for one targeted linear on one TP rank, laid out like the
    linear's local output; `enabled = False` makes it add nothing (the reference policy)."""

    def __init__(self, layout: AdapterLayout, lora: LoraConfig, dtype: torch.dtype, device):
        super().__init__()
        self.layout, self.scale, self.dropout = layout, lora.alpha / lora.rank, lora.dropout
        self.enabled = True
        self.lora_A, self.lora_B = torch.nn.ParameterDict(), torch.nn.ParameterDict()
        row = layout.parallel == "row"
        for i, part in enumerate(layout.parts):
            key = _key(part)
            b_rows = sum(end - first for first, end in layout.b_rows(i))
            self.lora_A[key] = torch.nn.Parameter(
                torch.zeros(layout.a_shape(i, lora.rank), dtype=dtype, device=device)
            )
            self.lora_B[key] = torch.nn.Parameter(torch.zeros(b_rows, lora.rank, dtype=dtype, device=device))
            _mark_tensor_parallel(self.lora_A[key], 1 if row else None)
            _mark_tensor_parallel(self.lora_B[key], None if row else 0)

    def _dropped(self, x: torch.Tensor) -> torch.Tensor:
        """Inverted dropout with one mask over the whole input width, of which this rank keeps its
        columns (row-parallel) or all (column-parallel)."""
        if not self.training or self.dropout == 0:
            return x
        width = self.layout.shapes[0][1]
        first = self.layout.columns[0] if self.layout.parallel == "row" else 0
        keep = torch.rand(*x.shape[:-1], width, device=x.device) >= self.dropout  # (s, b, in)
        return x * keep[..., first : first + x.shape[-1]] / (1 - self.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x (s, b, in_local)
        from megatron.core.tensor_parallel import (
            copy_to_tensor_model_parallel_region,
            reduce_from_tensor_model_parallel_region,
        )

        x = self._dropped(x)
        keys = [_key(part) for part in self.layout.parts]
        if self.layout.parallel == "row":
            a = reduce_from_tensor_model_parallel_region(x @ self.lora_A[keys[0]].T)  # (s, b, r)
            return self.scale * (a @ self.lora_B[keys[0]].T)  # (s, b, out)
        a = torch.cat([x @ self.lora_A[key].T for key in keys], dim=-1)  # (s, b, P*r)
        a = copy_to_tensor_model_parallel_region(a).chunk(len(keys), dim=-1)  # P x (s, b, r)
        outputs = [a_part @ self.lora_B[key].T for a_part, key in zip(a, keys, strict=True)]  # (s, b, rows_p)
        return self.scale * torch.cat(self._local_order(outputs), dim=-1)  # (s, b, out_local)

    def _local_order(self, outputs: list[torch.Tensor]) -> list[torch.Tensor]:
        """The parts' output slices in the fused local row order (segments)."""
        offsets, pieces = [0] * len(outputs), []
        for part, first, end in self.layout.segments:
            pieces.append(outputs[part][..., offsets[part] : offsets[part] + end - first])
            offsets[part] += end - first
        return pieces


def _key(part: str) -> str:
    """ParameterDict key of an HF projection ("self_attn.q_proj" -> "q_proj")."""
    return part.rsplit(".", 1)[-1]


def _add_adapter_output(module, args, kwargs, output):
    """Forward hook of a targeted linear: (out, bias) -> (out + adapter(input), bias)."""
    adapter = module.lora
    if not adapter.enabled:
        return output
    x = args[0] if args else kwargs["input_"]
    out, bias = output
    return out + adapter(x), bias


# ---------------------------------------------------------------- distributed checkpoints


def _sharded_state_dict_with_adapter(
    linear, base_sharded_state_dict, prefix="", sharded_offsets=(), metadata=None
):
    """The linear's Megatron sharded state dict with its adapter's tensors sharded like the base
    weight. Megatron-Core's own would store the adapter (a child module's tensors, outside its
    axis map) as replicated: one TP rank's B rows under the whole name, the others' lost."""
    from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

    state = base_sharded_state_dict(prefix, sharded_offsets, metadata)
    base = {key: value for key, value in state.items() if not key.startswith(f"{prefix}lora.")}
    adapter = linear.lora
    check_evenly_sharded(adapter.layout)
    adapter_state = make_sharded_tensors_for_checkpoint(
        adapter.state_dict(prefix="", keep_vars=True),
        f"{prefix}lora.",
        tp_axes(adapter.layout),
        sharded_offsets,
        tp_group=linear.tp_group,
        dp_cp_group=metadata["dp_cp_group"],
    )
    return {**base, **adapter_state}


def tp_axes(layout: AdapterLayout) -> dict[str, int]:
    """The adapter tensors split over TP and their split axis (the others are whole on every rank)."""
    keys = [_key(part) for part in layout.parts]
    if layout.parallel == "row":
        return {f"lora_A.{key}": 1 for key in keys}
    return {f"lora_B.{key}": 0 for key in keys}


def check_evenly_sharded(layout: AdapterLayout) -> None:
    """Checkpoints store a split tensor as equal contiguous chunks, one per TP rank: true for
    every part unless TP exceeds the KV heads (then a rank's fused QKV rows hold no k or v)."""
    if layout.parallel == "row":
        return
    for i, part in enumerate(layout.parts):
        index, out = layout.b_index(i), layout.shapes[i][0]
        size = len(index)
        first = int(index[0]) if size else 0
        if (
            not size
            or out % size
            or first % size
            or not torch.equal(index, torch.arange(first, first + size))
        ):
            raise ValueError(
                f"LoRA checkpoints of {part} need tensor_model_parallel_size to divide the number of "
                "KV heads (each rank's slice of the fused QKV rows then holds whole q, k and v parts)"
            )


# ---------------------------------------------------------------- attaching, switching off


def _layer_modules(model) -> Iterator[tuple[int, str, torch.nn.Module]]:
    """(global layer index, target, linear) of every targetable linear on this stage (attention
    only on mixture-of-experts models, whose MLP is Megatron's MoE layer)."""
    targets = {
        t: v for t, v in TARGETS.items() if not (model.hf_config.num_experts and v[0].startswith("mlp."))
    }
    for layer in model.decoder.layers:
        for target, (path, _, _) in targets.items():
            yield layer.layer_number - 1, target, layer.get_submodule(path)


def attach_lora(model, lora: LoraConfig) -> None:
    """Freeze `model`'s base parameters and put adapters (initialised as the module docstring says)
    on the targeted linears of its layers. `model`: a GPTModel from `build_model` before wrapping."""
    from megatron.core import parallel_state

    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tp = parallel_state.get_tensor_model_parallel_world_size()
    for param in model.parameters():
        param.requires_grad_(False)
    for g, target, linear in _layer_modules(model):
        if target not in lora.target_modules:
            continue
        layout = adapter_layout(model.hf_config, target, tp_rank, tp)
        linear.lora = LoraAdapter(layout, lora, model.config.params_dtype, linear.weight.device)
        linear.register_forward_hook(_add_adapter_output, with_kwargs=True)
        linear.sharded_state_dict = partial(
            _sharded_state_dict_with_adapter, linear, linear.sharded_state_dict
        )
        load_adapter_tensors(linear.lora, initial_adapter_tensors(g, layout, lora))
    model.lora_config = lora


def initial_adapter_tensors(layer: int, layout: AdapterLayout, lora: LoraConfig) -> dict[str, torch.Tensor]:
    """Whole (A, B) of each part by peft name: A drawn from `lora.seed` and (layer, part), B zero."""
    tensors = {}
    for part, (out, width) in zip(layout.parts, layout.shapes, strict=True):
        name = peft_name(layer, part)
        gen = torch.Generator().manual_seed(_stream(lora.seed, name))
        bound = 1 / math.sqrt(width)
        tensors[name + ".lora_A.weight"] = (torch.rand(lora.rank, width, generator=gen) * 2 - 1) * bound
        tensors[name + ".lora_B.weight"] = torch.zeros(out, lora.rank)
    return tensors


def _stream(seed: int, name: str) -> int:
    """A generator seed for one tensor, the same in every process (unlike Python's str hash)."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") % 2**63


def peft_name(layer: int, part: str) -> str:
    """peft's module name of HF projection `part` in global layer `layer` (no .lora_A.weight)."""
    return f"{PEFT_PREFIX}model.layers.{layer}.{part}"


def adapters(chunks) -> Iterator[tuple[int, LoraAdapter]]:
    """(global layer index, adapter) of every adapter on this rank."""
    for chunk in chunks:
        for g, _, linear in _layer_modules(unwrap_model(chunk)):
            if hasattr(linear, "lora"):
                yield g, linear.lora


@contextmanager
def adapters_disabled(chunks):
    """The base model inside the block (the reference policy): no second copy of the weights."""
    found = [adapter for _, adapter in adapters(chunks)]
    for adapter in found:
        adapter.enabled = False
    try:
        yield
    finally:
        for adapter in found:
            adapter.enabled = True


# ---------------------------------------------------------------- whole tensors <-> shards


@torch.no_grad()
def load_adapter_tensors(adapter: LoraAdapter, tensors: dict[str, torch.Tensor]) -> None:
    """Copy this rank's slices of whole peft-named (A, B) tensors into `adapter`'s parameters."""
    layout = adapter.layout
    for i, part in enumerate(layout.parts):
        name, key = _find_name(tensors, part), _key(part)
        whole_a, whole_b = tensors[name + ".lora_A.weight"], tensors[name + ".lora_B.weight"]
        _check_shape(name + ".lora_A.weight", whole_a, (adapter.lora_A[key].shape[0], layout.shapes[i][1]))
        _check_shape(name + ".lora_B.weight", whole_b, (layout.shapes[i][0], adapter.lora_B[key].shape[1]))
        first, end = layout.columns if layout.parallel == "row" else (0, whole_a.shape[1])
        adapter.lora_A[key].copy_(whole_a[:, first:end])
        adapter.lora_B[key].copy_(whole_b[layout.b_index(i)])


def _find_name(tensors: dict[str, torch.Tensor], part: str) -> str:
    suffix = f".{part}.lora_A.weight"
    names = [n.removesuffix(".lora_A.weight") for n in tensors if n.endswith(suffix)]
    if len(names) != 1:
        raise ValueError(f"expected one adapter for {part}, found {names or 'none'} in the tensors given")
    return names[0]


def _check_shape(name: str, tensor: torch.Tensor, expected: tuple[int, int]) -> None:
    if tuple(tensor.shape) != tuple(expected):
        raise ValueError(f"adapter tensor {name} has shape {tuple(tensor.shape)}, expected {tuple(expected)}")


def load_lora_tensors(chunks, tensors: dict[str, torch.Tensor]) -> None:
    """Load whole peft-named adapter tensors (an adapter_model.safetensors' keys) into every
    adapter; ValueError naming the tensors missing or unexpected for this model's adapters."""
    model = unwrap_model(chunks[0])
    check_adapter_names(adapter_names(model.hf_config, model.lora_config), set(tensors))
    for g, adapter in adapters(chunks):
        prefix = f"{PEFT_PREFIX}model.layers.{g}."
        load_adapter_tensors(adapter, {n: t for n, t in tensors.items() if n.startswith(prefix)})


def adapter_names(hf: HFModelConfig, lora: LoraConfig) -> list[str]:
    """peft names of every adapter tensor of the whole model, in `iter_lora_tensors` order."""
    return [
        f"{peft_name(g, TARGETS[target][2][i])}.lora_{which}.weight"
        for g, target, i, which, _ in adapter_tensor_shapes(hf, lora)
    ]


def check_adapter_names(expected: list[str], given: set[str]) -> None:
    """ValueError listing (the first few) adapter tensors missing from `given` or not expected."""
    missing = [name for name in expected if name not in given]
    unexpected = sorted(given - set(expected))
    if missing or unexpected:
        raise ValueError(
            f"adapter tensors do not match actor.lora.target_modules on this model: {len(missing)} "
            f"missing {missing[:3]}, {len(unexpected)} unexpected {unexpected[:3]}"
        )


def _whole(adapter: LoraAdapter, part: int, which: str) -> torch.Tensor:
    """The whole A or B of one part on every TP rank: each rank fills its slice of a zero tensor
    and the TP group sums them (exact: every element comes from one rank)."""
    from megatron.core import parallel_state

    layout, key = adapter.layout, _key(adapter.layout.parts[part])
    local = (adapter.lora_A if which == "A" else adapter.lora_B)[key].detach()
    if (which == "A") == (layout.parallel == "column"):  # whole on every rank
        return local.clone()
    out, width = layout.shapes[part]
    rank = adapter.lora_A[key].shape[0]
    whole = local.new_zeros((rank, width) if which == "A" else (out, rank))
    if which == "A":
        whole[:, layout.columns[0] : layout.columns[1]] = local
    else:
        whole[layout.b_index(part).to(whole.device)] = local
    dist.all_reduce(whole, group=parallel_state.get_tensor_model_parallel_group())
    return whole


def adapter_tensor_shapes(hf: HFModelConfig, lora: LoraConfig) -> Iterator[tuple[int, str, int, str, tuple]]:
    """(global layer, target, part index, "A" | "B", whole shape) of every adapter tensor, in the
    order `iter_lora_tensors` yields them."""
    for g in range(hf.num_hidden_layers):
        for target in lora.target_modules:
            for i, (out, width) in enumerate(_part_shapes(hf, target)):
                yield g, target, i, "A", (lora.rank, width)
                yield g, target, i, "B", (out, lora.rank)


class WholeAdapters:
    """Whole adapter tensors of one model on every rank of its model-parallel group, fetched one
    at a time in the same order on every rank (collective): the owning pipeline stage assembles
    each over its TP group and broadcasts it over the pipeline group."""

    def __init__(self, chunks):
        from megatron.core import parallel_state

        model = unwrap_model(chunks[0])
        self.hf, self.lora, self.dtype = model.hf_config, model.lora_config, model.config.params_dtype
        self.pp = parallel_state.get_pipeline_model_parallel_world_size()
        self.pp_group = parallel_state.get_pipeline_model_parallel_group()
        self.local = {(g, adapter.layout.target): adapter for g, adapter in adapters(chunks)}
        self.device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"

    def get(self, g: int, target: str, part: int, which: str, shape: tuple) -> torch.Tensor:
        owned = self.local.get((g, target))
        if owned is not None:
            tensor = _whole(owned, part, which)
        else:
            tensor = torch.empty(shape, dtype=self.dtype, device=self.device)
        if self.pp > 1:
            stage = g // (self.hf.num_hidden_layers // self.pp)
            dist.broadcast(tensor, group=self.pp_group, group_src=stage)
        return tensor


def iter_lora_tensors(chunks) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (peft name, whole tensor) of every adapter of the model, in layer order, on every
    rank. Collective over the model-parallel group like `weights.iter_hf_tensors`."""
    whole = WholeAdapters(chunks)
    names = adapter_names(whole.hf, whole.lora)
    for name, place in zip(names, adapter_tensor_shapes(whole.hf, whole.lora), strict=True):
        yield name, whole.get(*place)


def lora_merger(chunks):
    """None for a model without adapters or with them disabled (`adapters_disabled`); else
    `merge(hf_name, tensor)`, which returns the base HF tensor plus `(B @ A) * alpha / rank` of its
    adapter (peft's merge order) or the tensor itself. Collective for adapted tensors: call it for
    every HF tensor, in the same order on every rank (as `weights.iter_hf_tensors` does)."""
    model = unwrap_model(chunks[0])
    lora = getattr(model, "lora_config", None)
    if lora is None or not lora.rank or any(not adapter.enabled for _, adapter in adapters(chunks)):
        return None  # inside `adapters_disabled` the stream is the base model's
    whole, scale = WholeAdapters(chunks), lora.alpha / lora.rank
    adapted = {
        f"model.layers.{g}.{part}.weight": (g, target, i, shape)
        for g in range(whole.hf.num_hidden_layers)
        for target in lora.target_modules
        for i, (part, shape) in enumerate(
            zip(TARGETS[target][2], _part_shapes(whole.hf, target), strict=True)
        )
    }

    def merge(name: str, tensor: torch.Tensor) -> torch.Tensor:
        if name not in adapted:
            return tensor
        g, target, i, (out, width) = adapted[name]
        a = whole.get(g, target, i, "A", (lora.rank, width))  # (r, in)
        b = whole.get(g, target, i, "B", (out, lora.rank))  # (out, r)
        return tensor + (b @ a) * scale  # (out, in)

    return merge


def save_peft_adapter(chunks, out_dir) -> None:
    """Write the adapters as a peft adapter directory (`adapter_config.json` +
    `adapter_model.safetensors`) that `peft.PeftModel.from_pretrained(<HF model>, out_dir)` loads.
    Collective like `iter_lora_tensors`; global rank 0 writes."""
    from safetensors.torch import save_file

    model = unwrap_model(chunks[0])
    tensors = {name: tensor.cpu() for name, tensor in iter_lora_tensors(chunks)}
    if dist.get_rank() == 0:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
        config = peft_adapter_config(model.lora_config, model.hf_config.source_dir)
        (out / "adapter_config.json").write_text(json.dumps(config, indent=2))
    dist.barrier()


def peft_adapter_config(lora: LoraConfig, base_model: str) -> dict:
    """peft's adapter_config.json for these adapters (the fields peft 0.21's LoraConfig reads;
    the rest keep peft's defaults): the HF module names, scale alpha / r, no bias training."""
    modules = [_key(part) for target in lora.target_modules for part in TARGETS[target][2]]
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": modules,
        "bias": "none",
        "use_rslora": False,
        "fan_in_fan_out": False,
    }


def parameter_counts(chunks, optimizer=None) -> dict[str, int]:
    """Elements of the whole model, trainable (the adapters under LoRA) and in all (with the padded
    vocabulary rows), each counted once over the model-parallel group (a TP duplicate on TP rank
    0, a tied output copy on the embedding's stage only); with `optimizer`, the bytes of this
    rank's optimizer state (Adam's moments, present after the first step)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
    from megatron.core.transformer.module import param_is_not_shared

    counted = [
        p
        for chunk in chunks
        for p in unwrap_model(chunk).parameters()
        if param_is_not_shared(p) and param_is_not_tensor_parallel_duplicate(p)
    ]
    counts = torch.tensor(
        [sum(p.numel() for p in counted if p.requires_grad), sum(p.numel() for p in counted)]
    )
    if torch.cuda.is_available():  # NCCL reduces device tensors only
        counts = counts.cuda()
    dist.all_reduce(counts, group=parallel_state.get_model_parallel_group())
    result = {"trainable_params": int(counts[0]), "total_params": int(counts[1])}
    if optimizer is not None:
        state = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.dim()]
        result["optimizer_state_bytes"] = sum(t.numel() * t.element_size() for t in state)
    return result
