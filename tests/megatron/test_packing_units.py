"""Sequence packing and token-budget micro-batches: the plain decisions (packing.py) and the
packed SDPA core attention, in process, against hand-computed values and naive attention."""

import math

import pytest
import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer import TransformerConfig

from engines.megatron import packing
from engines.megatron.attention import SDPACoreAttention


def test_pack_micro_batch_by_hand():
    # two rows, T = 5, R = 2: row 0 = prompt [7, 8] + response [9]; row 1 = prompt [4] + response [5, 6]
    input_ids = torch.tensor([[0, 7, 8, 9, 0], [0, 0, 4, 5, 6]])
    mask = (input_ids > 0).long()
    packed = packing.pack_micro_batch(input_ids, mask, response_len=2, total=8)
    assert packed.input_ids.tolist() == [[7, 8, 9, 4, 5, 6, 0, 0]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 0, 1, 2, 0, 0]]
    assert packed.cu_seqlens.tolist() == [0, 3, 6] and packed.cu_seqlens_padded.tolist() == [0, 3, 8]
    assert packed.cu_seqlens.dtype == torch.int32 and packed.max_seqlen == 5
    # response tokens 9 (row 0), 5 and 6 (row 1) are predicted by the outputs at 8, 4 and 5
    assert packed.response_index.tolist() == [1, 3, 4]
    assert packed.last_index.tolist() == [2, 5]


def test_pack_rejects_a_length_below_the_real_tokens_and_packs_an_empty_group():
    input_ids = torch.tensor([[3, 4, 5]])
    with pytest.raises(ValueError, match="packed length 2 is below the 3 real tokens"):
        packing.pack_micro_batch(input_ids, torch.ones_like(input_ids), 1, total=2)
    empty = packing.pack_micro_batch(input_ids[:0], input_ids[:0], 1, total=4)
    assert empty.cu_seqlens.tolist() == [0] and empty.cu_seqlens_padded.tolist() == [4]
    assert empty.input_ids.tolist() == [[0, 0, 0, 0]] and empty.response_index.numel() == 0


def test_lengths_multiple_and_fixed_pipeline_shapes():
    assert packing.length_multiple(4, sequence_parallel=True, context_parallel_size=1) == 4
    assert packing.length_multiple(4, sequence_parallel=False, context_parallel_size=1) == 1
    with pytest.raises(ValueError, match="context_parallel_size 1 only"):
        packing.length_multiple(1, False, 2)
    groups, lengths = [[0, 1], [2], []], [3, 4, 9]
    assert packing.packed_lengths(groups, lengths, 4, pipelined=False) == [8, 12, 4]
    assert packing.packed_lengths(groups, lengths, 1, pipelined=True) == [9, 9, 9]


def test_partition_is_longest_first_to_the_least_loaded_group():
    # 9 -> g0; 7 -> g1; 5 -> g1 (7 < 9); 4 -> g0 (9 < 12); 2 -> g1 (12 < 13)
    assert packing.partition_by_tokens([4, 9, 2, 7, 5], 2) == [[0, 1], [2, 3, 4]]


def test_token_budget_groups_fit_the_budget_with_the_fewest_micro_batches():
    lengths = [30, 5, 12, 40, 3, 8, 20, 1]  # 119 tokens
    groups = packing.token_budget_groups(lengths, 40, "budget")
    assert len(groups) == 3  # ceil(119 / 40) = 3 and a fitting partition exists
    assert sorted(i for g in groups for i in g) == list(range(8))
    assert all(sum(lengths[i] for i in g) <= 40 for g in groups)
    assert packing.token_budget_groups(lengths, 1000, "budget") == [list(range(8))]


def test_token_budget_groups_take_the_count_other_ranks_need():
    lengths = [5, 5, 5]
    agreed = packing.token_budget_groups(lengths, 100, "budget", agree_max=lambda k: max(k, 2))
    assert len(agreed) == 2 and sorted(i for g in agreed for i in g) == [0, 1, 2]
    padded_out = packing.token_budget_groups(lengths, 100, "budget", agree_max=lambda k: max(k, 5))
    assert len(padded_out) == 5 and sum(len(g) == 0 for g in padded_out) == 2  # empty micro-batches


def test_token_budget_below_the_longest_row_names_the_key():
    with pytest.raises(ValueError, match=r"actor.update.max_token_len_per_gpu=10 is below .* \(12 tokens"):
        packing.token_budget_groups([3, 12], 10, "actor.update.max_token_len_per_gpu")


def test_restore_order_undoes_the_grouping():
    groups = [[1, 3], [0], [2]]
    per_group = [torch.tensor([[1.0], [3.0]]), torch.tensor([[0.0]]), torch.tensor([[2.0]])]
    assert packing.restore_order(per_group, groups).flatten().tolist() == [0.0, 1.0, 2.0, 3.0]


def _naive_causal(q, k, v):
    """q (n, L, d), k / v (n, L, d): causal softmax attention written out."""
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    causal = torch.ones(q.shape[1], q.shape[1], dtype=torch.bool).tril()
    return torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1) @ v


def test_packed_sdpa_attention_is_per_sequence_causal_with_gqa_and_zero_padding():
    config = TransformerConfig(
        num_layers=1, hidden_size=16, num_attention_heads=4, num_query_groups=2, attention_dropout=0.0
    )
    attention = SDPACoreAttention(config, layer_number=1, attn_mask_type=None, attention_type="self")
    torch.manual_seed(0)
    lengths, total, heads, groups, dim = [3, 1, 4], 10, 4, 2, 4
    q = torch.randn(total, heads, dim, requires_grad=True)
    k, v = torch.randn(total, groups, dim), torch.randn(total, groups, dim)
    cu = torch.tensor([0, 3, 4, 8], dtype=torch.int32)
    params = PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
        cu_seqlens_q_padded=torch.tensor([0, 3, 4, 10], dtype=torch.int32),
        cu_seqlens_kv_padded=torch.tensor([0, 3, 4, 10], dtype=torch.int32), max_seqlen_q=6, max_seqlen_kv=6,
    )  # fmt: skip
    out = attention(q, k, v, None, packed_seq_params=params)  # (t, n * d)
    assert out.shape == (total, heads * dim)
    start = 0
    for length in lengths:
        span = slice(start, start + length)
        expected = _naive_causal(
            q[span].transpose(0, 1),
            k[span].transpose(0, 1).repeat_interleave(2, dim=0),
            v[span].transpose(0, 1).repeat_interleave(2, dim=0),
        )  # (n, L, d)
        torch.testing.assert_close(out[span], expected.transpose(0, 1).reshape(length, -1))
        start += length
    assert torch.all(out[8:] == 0)  # tail padding
    out.sum().backward()
    # the first query of a sequence sees only its own key (no gradient); later ones do
    assert torch.all(q.grad[8:] == 0) and torch.all(q.grad[[1, 2, 5, 6, 7]].abs().sum(-1) > 0)
