"""The HF <-> Megatron tensor layouts, shard by shard, without process groups.

The fused QKV reference is built the way Megatron-Core reads it back in
`Attention.get_query_key_value_tensors`: rows grouped per KV head as [q heads of g, k_g, v_g].
"""

from contextlib import ExitStack

import pytest
import torch
from safetensors.torch import save_file

from engines.megatron.config import MegatronConfig
from engines.megatron.model import HFModelConfig, padded_vocab_size
from engines.megatron.qkv_layout import qkv_row_sources, split_fused_qkv
from engines.megatron.weights import ModelLayout, SafetensorsReader, read_shard, weight_plan

HIDDEN, HEAD_DIM = 6, 2


def hf_config(heads: int, kv_heads: int, vocab: int = 10, tie: bool = False) -> HFModelConfig:
    return HFModelConfig(
        architecture="Qwen2ForCausalLM", model_type="qwen2", vocab_size=vocab, hidden_size=HIDDEN,
        intermediate_size=8, num_hidden_layers=2, num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=HEAD_DIM, rms_norm_eps=1e-6, rope_theta=1e4, max_position_embeddings=64,
        tie_word_embeddings=tie, qkv_bias=True,
    )  # fmt: skip


def megatron_fused_qkv(q, k, v, groups):
    """Megatron's fused layout: per KV group g, [q rows of g's heads; k_g; v_g]."""
    per_group = [t.reshape(groups, -1, *t.shape[1:]) for t in (q, k, v)]
    return torch.cat(per_group, dim=1).reshape(-1, *q.shape[1:])


@pytest.fixture
def checkpoint(tmp_path):
    torch.manual_seed(0)
    tensors = {
        "q.weight": torch.randn(8 * HEAD_DIM, HIDDEN),
        "k.weight": torch.randn(2 * HEAD_DIM, HIDDEN),
        "v.weight": torch.randn(2 * HEAD_DIM, HIDDEN),
        "gate.weight": torch.randn(8, HIDDEN),
        "up.weight": torch.randn(8, HIDDEN),
        "down.weight": torch.randn(HIDDEN, 8),
        "embed.weight": torch.randn(10, HIDDEN),
    }
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with ExitStack() as stack:
        yield tensors, SafetensorsReader(tmp_path, stack)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_qkv_shards_are_contiguous_chunks_of_the_grouped_layout(checkpoint, tp):
    tensors, reader = checkpoint
    hf = hf_config(heads=8, kv_heads=2)  # tp=4 > 2 KV heads: Megatron's KV-head sharing branch
    plan = next(p for p in weight_plan(hf, ModelLayout(tp, 1, 16, False, False)) if p.kind == "qkv")
    plan = type(plan)(plan.megatron_name, "qkv", ("q.weight", "k.weight", "v.weight"), plan.full_shape, 0)
    fused = megatron_fused_qkv(tensors["q.weight"], tensors["k.weight"], tensors["v.weight"], groups=2)
    shards = [read_shard(reader, hf, plan, r, tp) for r in range(tp)]
    assert torch.equal(torch.cat(shards), fused)
    for r, shard in enumerate(shards):
        assert torch.equal(shard, fused.chunk(tp)[r])
    q, k, v = split_fused_qkv(torch.cat(shards), groups=2, q_per_group=4, head_dim=HEAD_DIM)
    assert torch.equal(q, tensors["q.weight"]) and torch.equal(k, tensors["k.weight"])
    assert torch.equal(v, tensors["v.weight"])


def test_qkv_row_sources_split_one_group_across_ranks():
    # 1 group of 2 q heads (d=2): block rows [q0 q0 q1 q1 k k v v]; 2 ranks take 4 rows each.
    assert qkv_row_sources(0, 4, groups=1, q_per_group=2, head_dim=2) == [(0, 0, 4)]
    assert qkv_row_sources(4, 8, groups=1, q_per_group=2, head_dim=2) == [(1, 0, 2), (2, 0, 2)]


@pytest.mark.parametrize("tp", [1, 2])
def test_gate_up_shard_is_gate_slice_then_up_slice(checkpoint, tp):
    tensors, reader = checkpoint
    hf = hf_config(heads=8, kv_heads=2)
    plan = next(p for p in weight_plan(hf, ModelLayout(tp, 1, 16, False, False)) if p.kind == "gate_up")
    plan = type(plan)(plan.megatron_name, "gate_up", ("gate.weight", "up.weight"), plan.full_shape, 0)
    for r in range(tp):
        rows = slice(r * 8 // tp, (r + 1) * 8 // tp)
        expected = torch.cat([tensors["gate.weight"][rows], tensors["up.weight"][rows]])
        assert torch.equal(read_shard(reader, hf, plan, r, tp), expected)


def test_row_parallel_shard_splits_input_columns(checkpoint):
    tensors, reader = checkpoint
    hf = hf_config(heads=8, kv_heads=2)
    plan = next(
        p
        for p in weight_plan(hf, ModelLayout(2, 1, 16, False, False))
        if p.megatron_name.endswith("fc2.weight")
    )
    plan = type(plan)(plan.megatron_name, "row", ("down.weight",), plan.full_shape, 0)
    assert torch.equal(read_shard(reader, hf, plan, 1, 2), tensors["down.weight"][:, 4:])


def test_vocab_shards_are_zero_padded_beyond_the_real_vocabulary(checkpoint):
    tensors, reader = checkpoint
    hf = hf_config(heads=8, kv_heads=2, vocab=10)
    padded = padded_vocab_size(
        10, MegatronConfig(tensor_model_parallel_size=2, make_vocab_size_divisible_by=4)
    )
    assert padded == 16
    plan = weight_plan(hf, ModelLayout(2, 1, padded, False, False))[0]
    plan = type(plan)(plan.megatron_name, "vocab", ("embed.weight",), plan.full_shape, 0)
    first, second = (read_shard(reader, hf, plan, r, 2) for r in range(2))
    assert torch.equal(first, tensors["embed.weight"][:8])
    assert torch.equal(second[:2], tensors["embed.weight"][8:]) and not second[2:].any()


def test_plan_assigns_layers_and_heads_to_pipeline_stages():
    plan = weight_plan(hf_config(heads=8, kv_heads=2, tie=False), ModelLayout(1, 2, 16, False, False))
    owners = {p.hf_names[0]: p.owner_pp for p in plan}
    assert owners["model.embed_tokens.weight"] == 0 and owners["lm_head.weight"] == 1
    assert owners["model.layers.0.self_attn.q_proj.weight"] == 0
    assert owners["model.layers.1.self_attn.q_proj.weight"] == 1
    layer1 = next(p for p in plan if p.hf_names[0] == "model.layers.1.mlp.gate_proj.weight")
    assert layer1.megatron_name == "decoder.layers.0.mlp.linear_fc1.weight"  # local index on stage 1
    tied = weight_plan(hf_config(heads=8, kv_heads=2, tie=True), ModelLayout(1, 2, 16, False, False))
    assert "lm_head.weight" not in {n for p in tied for n in p.hf_names}
    value = weight_plan(hf_config(heads=8, kv_heads=2), ModelLayout(1, 1, 16, True, False))
    assert value[-1].hf_names == ("score.weight",) and value[-1].kind == "replicated"


def moe_config(model_type: str) -> HFModelConfig:
    architecture = {"qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM"}[model_type]
    return HFModelConfig(
        architecture=architecture, model_type=model_type, vocab_size=10, hidden_size=HIDDEN,
        intermediate_size=8, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        head_dim=HEAD_DIM, rms_norm_eps=1e-6, rope_theta=1e4, max_position_embeddings=64,
        tie_word_embeddings=False, qkv_bias=False, qk_layernorm=model_type == "qwen3_moe",
        num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=4,
    )  # fmt: skip


@pytest.mark.parametrize(("ep", "grouped"), [(1, False), (2, False), (4, False), (2, True)])
def test_expert_e_lives_on_ep_rank_e_div_local_count_as_local_expert_e_mod(ep, grouped):
    plans = weight_plan(moe_config("qwen3_moe"), ModelLayout(2, 2, 16, False, grouped, ep, 1, grouped))
    fc1 = [p for p in plans if p.expert and p.kind == "gate_up"]
    assert len(fc1) == 2 * 4  # 2 layers x 4 experts, each once
    per_rank = 4 // ep
    for p in fc1:
        layer, e = int(p.hf_names[0].split(".")[2]), int(p.hf_names[0].split(".")[5])
        assert p.hf_names == (
            f"model.layers.{layer}.mlp.experts.{e}.gate_proj.weight",
            f"model.layers.{layer}.mlp.experts.{e}.up_proj.weight",
        )
        assert (p.owner_ep, p.owner_pp, p.full_shape) == (e // per_rank, layer // 1, (8, HIDDEN))
        local = e % per_rank
        expected = (
            f"mlp.experts.linear_fc1.weight{local}"
            if grouped
            else f"mlp.experts.local_experts.{local}.linear_fc1.weight"
        )
        assert p.megatron_name == f"decoder.layers.0.{expected}"
    names = {p.megatron_name: p for p in plans if p.owner_pp == 0}
    assert names["decoder.layers.0.mlp.router.weight"].hf_names == ("model.layers.0.mlp.gate.weight",)
    assert names["decoder.layers.0.self_attention.q_layernorm.weight"].full_shape == (HEAD_DIM,)
    # TE's MoE layers keep a separate pre-MLP norm even when the input norm is fused into linear_qkv
    assert "decoder.layers.0.pre_mlp_layernorm.weight" in names


def test_mixtral_experts_use_its_checkpoint_names():
    plans = weight_plan(moe_config("mixtral"), ModelLayout(1, 1, 16, False, False, 2, 1, False))
    hf_names = {n for p in plans for n in p.hf_names}
    assert "model.layers.1.block_sparse_moe.gate.weight" in hf_names
    assert {f"model.layers.1.block_sparse_moe.experts.3.{w}.weight" for w in ("w1", "w2", "w3")} <= hf_names
    assert not any("q_norm" in n for n in hf_names)
