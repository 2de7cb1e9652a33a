"""LoRA's plain parts, one process: the adapter shards follow the base weight's TP split (fused
QKV grouped per KV head, also when TP exceeds the KV heads; [gate_r; up_r]; row-parallel input
columns), loading whole peft tensors slices them so, and bad settings are refused by name."""

import pytest
import torch

from engines.megatron.config import LoraConfig, MegatronConfig
from engines.megatron.lora import LoraAdapter, adapter_layout, load_adapter_tensors, validate_lora_layout
from engines.megatron.model import HFModelConfig
from engines.megatron.qkv_layout import split_fused_qkv

RANK = 2


def hf_config(heads=4, kv_heads=2, head_dim=4, hidden=16, ffn=24, experts=0) -> HFModelConfig:
    return HFModelConfig(
        architecture="Qwen2ForCausalLM", model_type="qwen2", vocab_size=32, hidden_size=hidden,
        intermediate_size=ffn, num_hidden_layers=2, num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=head_dim, rms_norm_eps=1e-6, rope_theta=1e4, max_position_embeddings=64,
        tie_word_embeddings=False, qkv_bias=True, num_experts=experts,
    )  # fmt: skip


def whole_tensors(hf, target) -> dict[str, torch.Tensor]:
    """Distinct whole (A, B) per part, peft-named for layer 0."""
    layout = adapter_layout(hf, target, 0, 1)
    gen, tensors = torch.Generator().manual_seed(0), {}
    for part, (out, width) in zip(layout.parts, layout.shapes, strict=True):
        name = f"base_model.model.model.layers.0.{part}"
        tensors[name + ".lora_A.weight"] = torch.randn(RANK, width, generator=gen)
        tensors[name + ".lora_B.weight"] = torch.randn(out, RANK, generator=gen)
    return tensors


def rank_adapter(hf, target, tp_rank, tp, tensors) -> LoraAdapter:
    adapter = LoraAdapter(
        adapter_layout(hf, target, tp_rank, tp), LoraConfig(rank=RANK), torch.float32, "cpu"
    )
    load_adapter_tensors(adapter, tensors)
    return adapter


def local_fused_b(adapter: LoraAdapter) -> torch.Tensor:
    """The rank's B rows in the linear's local output order (what forward lays out), (rows, r)."""
    outputs = [b.T for b in adapter.lora_B.values()]  # the parts' rows in the last dim, as in forward
    return torch.cat(adapter._local_order(outputs), dim=-1).T


def parts(tensors: dict, which: str) -> list[torch.Tensor]:
    return [t for n, t in tensors.items() if n.endswith(f"lora_{which}.weight")]


@pytest.mark.parametrize(("heads", "kv_heads", "tp"), [(4, 2, 1), (4, 2, 2), (4, 1, 2), (8, 2, 4), (2, 2, 2)])
def test_fused_qkv_adapter_rows_are_the_base_weight_layout(heads, kv_heads, tp):
    hf = hf_config(heads=heads, kv_heads=kv_heads)
    tensors = whole_tensors(hf, "linear_qkv")
    ranks = [rank_adapter(hf, "linear_qkv", r, tp, tensors) for r in range(tp)]
    fused = torch.cat([local_fused_b(a) for a in ranks])  # (fused rows, r), Megatron's layout
    for actual, expected in zip(
        split_fused_qkv(fused, kv_heads, heads // kv_heads, 4), parts(tensors, "B"), strict=True
    ):
        assert torch.equal(actual, expected)
    for adapter in ranks:  # A is whole on every rank, one per part
        assert all(
            torch.equal(a, b) for a, b in zip(adapter.lora_A.values(), parts(tensors, "A"), strict=True)
        )


def test_gate_up_adapter_rows_are_gate_then_up_of_each_rank():
    hf, tp = hf_config(), 2
    tensors = whole_tensors(hf, "linear_fc1")
    gate_b, up_b = parts(tensors, "B")
    for r in range(tp):
        rows = slice(r * 12, (r + 1) * 12)
        assert torch.equal(
            local_fused_b(rank_adapter(hf, "linear_fc1", r, tp, tensors)),
            torch.cat([gate_b[rows], up_b[rows]]),
        )


@pytest.mark.parametrize("target", ["linear_proj", "linear_fc2"])
def test_row_parallel_adapter_splits_a_by_input_columns_and_keeps_b_whole(target):
    hf, tp = hf_config(), 2
    tensors = whole_tensors(hf, target)
    (whole_a,), (whole_b,) = parts(tensors, "A"), parts(tensors, "B")
    width = whole_a.shape[1] // tp
    for r in range(tp):
        adapter = rank_adapter(hf, target, r, tp, tensors)
        (a,), (b,) = adapter.lora_A.values(), adapter.lora_B.values()
        assert torch.equal(a, whole_a[:, r * width : (r + 1) * width]) and torch.equal(b, whole_b)
        assert a.tensor_model_parallel and a.partition_dim == 1 and not b.tensor_model_parallel


def test_column_parallel_marks_a_as_a_tensor_parallel_duplicate():
    adapter = rank_adapter(hf_config(), "linear_qkv", 1, 2, whole_tensors(hf_config(), "linear_qkv"))
    assert not any(a.tensor_model_parallel for a in adapter.lora_A.values())
    assert all(b.tensor_model_parallel and b.partition_dim == 0 for b in adapter.lora_B.values())


def test_loading_refuses_a_wrong_shape_naming_the_tensor():
    hf = hf_config()
    tensors = whole_tensors(hf, "linear_proj")
    name = next(n for n in tensors if n.endswith("lora_A.weight"))
    tensors[name] = tensors[name][:, :-1]
    with pytest.raises(ValueError, match=r"o_proj\.lora_A\.weight has shape \(2, 15\), expected \(2, 16\)"):
        rank_adapter(hf, "linear_proj", 0, 1, tensors)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (dict(rank=-1), "actor.lora.rank must be >= 0"),
        (dict(rank=4, alpha=0.0), "actor.lora.alpha must be positive"),
        (dict(dropout=1.0), r"actor.lora.dropout must lie in \[0, 1\)"),
        (dict(target_modules=["q_proj"]), r"\['q_proj'\] are not Megatron-Core linear names; choose from"),
        (dict(rank=4, target_modules=[]), "actor.lora.target_modules is empty"),
        (dict(target_modules=["linear_qkv", "linear_qkv"]), "lists a module twice"),
    ],
)
def test_bad_lora_settings_are_refused_naming_the_key(settings, message):
    with pytest.raises(ValueError, match=message):
        LoraConfig(**settings)


@pytest.mark.parametrize(
    ("hf", "megatron", "transformer_engine", "message"),
    [
        (hf_config(), MegatronConfig(), True, "Transformer Engine's fused-norm linears"),
        (hf_config(), MegatronConfig(sequence_parallel=True), False, "sequence_parallel=true"),
        (
            hf_config(experts=4),
            MegatronConfig(),
            False,
            r"\['linear_fc1', 'linear_fc2'\]: adapters on mixture",
        ),
    ],
)
def test_unsupported_layouts_are_refused(hf, megatron, transformer_engine, message):
    with pytest.raises(ValueError, match=message):
        validate_lora_layout(hf, megatron, LoraConfig(rank=4), transformer_engine)
    validate_lora_layout(hf, megatron, LoraConfig(rank=0), transformer_engine)  # off: nothing to refuse


def test_moe_models_take_attention_adapters():
    validate_lora_layout(
        hf_config(experts=4), MegatronConfig(), LoraConfig(rank=4, target_modules=["linear_qkv"]), False
    )


@pytest.mark.usefixtures("in_quickstart_working_tree")
def test_lora_with_param_offload_is_refused():
    from pathlib import Path

    from hybridflow.checks.recipe import RecipeError, validate_recipe
    from hybridflow.config.loader import load_recipe

    recipe = Path(__file__).resolve().parents[2] / "recipes" / "quickstart.yaml"
    overrides = ["actor.lora.rank=8", "actor.megatron.param_offload=true"]
    with pytest.raises(RecipeError) as err:
        validate_recipe(load_recipe(recipe, overrides), cuda_available=False)
    refusal = "actor.lora.rank=8 with actor.megatron.param_offload=true"
    assert any(e.startswith(refusal) for e in err.value.errors), err.value.errors
    validate_recipe(load_recipe(recipe, overrides[:1]), cuda_available=False)  # the stage-1 export is there


def test_initial_adapters_are_peft_defaults_drawn_per_tensor_name():
    from engines.megatron.lora import initial_adapter_tensors

    hf, lora = hf_config(), LoraConfig(rank=RANK, seed=5)
    layout = adapter_layout(hf, "linear_qkv", 0, 1)
    first, again = initial_adapter_tensors(0, layout, lora), initial_adapter_tensors(0, layout, lora)
    other_layer = initial_adapter_tensors(1, layout, lora)
    other_seed = initial_adapter_tensors(0, layout, LoraConfig(rank=RANK, seed=6))
    a_names = [n for n in first if n.endswith("lora_A.weight")]
    assert len(a_names) == 3 and len({first[n].sum().item() for n in a_names}) == 3  # q, k, v differ
    for name, tensor in first.items():
        assert torch.equal(tensor, again[name])
        if name.endswith("lora_B.weight"):
            assert not tensor.any()  # B = 0: the adapted model starts as the base model
            continue
        assert 0 < tensor.abs().max() <= 1 / hf.hidden_size**0.5  # kaiming-uniform(a=sqrt(5)) bound
        assert not torch.equal(tensor, other_seed[name])
        assert not torch.equal(tensor, other_layer[name.replace("layers.0.", "layers.1.")])


def test_adapter_tensors_that_do_not_match_the_targets_are_refused_by_name():
    from engines.megatron.lora import adapter_names, check_adapter_names

    names = adapter_names(hf_config(), LoraConfig(rank=RANK, target_modules=["linear_proj"]))
    assert names == [
        f"base_model.model.model.layers.{g}.self_attn.o_proj.lora_{w}.weight" for g in (0, 1) for w in "AB"
    ]
    check_adapter_names(names, set(names))
    extra = "base_model.model.model.layers.0.mlp.down_proj.lora_A.weight"
    with pytest.raises(
        ValueError, match=r"1 missing \['base_model.*layers.1.*lora_B.weight'\], 1 unexpected"
    ):
        check_adapter_names(names, set(names[:-1]) | {extra})
