"""Delta weight transfer's pure part (engines/weight_sync/delta.py): a receiver applying the
changed elements to its copy holds exactly the sender's tensor (bits and checksum), over a run of
bf16 updates at RL learning rates; a tensor the receiver does not hold, or holds in another layout,
goes whole; a receiver whose copy is not the delta's base is refused by the checksum, by name."""

import itertools

import pytest
import torch

from engines.weight_sync.common import WeightSyncError, tensor_checksum
from engines.weight_sync.delta import DeltaStats, bits, decode_tensor, delta_positions, encode_tensor


def adam_like_steps(steps: int, lr: float, shape=(64, 96), seed: int = 0) -> list[torch.Tensor]:
    """bf16 weights after each of `steps` updates of fp32 master weights by about `lr` per element
    (Adam's normalized step), the first entry before any: what a sync sends after each update."""
    gen = torch.Generator().manual_seed(seed)
    master = torch.randn(shape, generator=gen) * 0.02  # (R, C) fp32
    out = [master.to(torch.bfloat16)]
    for _ in range(steps):
        master = master - lr * torch.randn(shape, generator=gen).sign()
        out.append(master.to(torch.bfloat16))
    return out


def test_a_small_float32_delta_by_hand():
    base = torch.arange(100, dtype=torch.float32)
    new = base.clone()
    new[[3, 50, 99]] = torch.tensor([-1.0, 0.5, 7.0])
    delta = encode_tensor(base, new)
    assert delta.indices.tolist() == [3, 50, 99] and delta.indices.dtype == torch.int32
    assert delta.values.tolist() == [-1.0, 0.5, 7.0]
    assert delta.nbytes() == 3 * (4 + 4)  # positions and values
    stats = DeltaStats()
    stats.add(delta)
    assert stats.metrics() == {
        "weight_sync/bytes_sent": 24.0,
        "weight_sync/bytes_full": 400.0,
        "weight_sync/changed_share": 0.03,
    }
    assert torch.equal(decode_tensor("w", base, delta), new)


@pytest.mark.parametrize("lr", [1e-6, 1e-5])
def test_a_receiver_applying_each_steps_delta_holds_the_senders_bits_at_every_step(lr):
    weights = adam_like_steps(10, lr)
    held = weights[0].clone()  # the receiver's copy after a full transfer
    shares = []
    for base, new in itertools.pairwise(weights):
        delta = encode_tensor(base, new)
        held = decode_tensor("layer.weight", held, delta)
        assert torch.equal(bits(held), bits(new)) and tensor_checksum(held) == tensor_checksum(new)
        stats = DeltaStats()
        stats.add(delta)
        shares.append(stats.metrics()["weight_sync/changed_share"])
    # most bf16 values round to what they were; a larger lr changes more of them
    assert all(0 < share < 0.5 for share in shares), shares


def test_many_changed_positions_go_as_a_bitmask_where_that_is_fewer_bytes():
    base = torch.zeros(64, dtype=torch.bfloat16)
    new = base.clone()
    new[[1, 9, 17, 63]] = 1.0  # 4 of 64: a list takes 16 bytes, a bitmask 8
    delta = encode_tensor(base, new)
    assert delta.indices.dtype == torch.uint8 and delta.indices.tolist() == [2, 2, 2, 0, 0, 0, 0, 128]
    assert delta.nbytes() == 8 + 4 * 2
    assert delta_positions(delta.indices, 64).tolist() == [1, 9, 17, 63]
    assert torch.equal(bits(decode_tensor("w", base, delta)), bits(new))
    few = base.clone()
    few[5] = 1.0  # 1 of 64: a list of 4 bytes is smaller
    assert encode_tensor(base, few).indices.tolist() == [5]


def test_bits_not_values_decide_what_changed():
    """-0.0 == 0.0 and NaN != NaN as values; as bits, the first pair differs and a NaN equals itself."""
    base = torch.tensor([0.0, float("nan"), 1.0, 2.0, 3.0, 4.0, 5.0, 6.0], dtype=torch.bfloat16)
    new = base.clone()
    new[0] = -0.0
    delta = encode_tensor(base, new)
    assert delta_positions(delta.indices, 8).tolist() == [0]  # the NaN unchanged, the sign of zero changed
    out = decode_tensor("w", base, delta)
    assert torch.equal(bits(out), bits(new))
    payload = torch.tensor([0x7FC1], dtype=torch.int16).view(torch.bfloat16)  # a NaN with a payload
    new[1] = payload[0]
    assert bits(decode_tensor("w", base, encode_tensor(base, new)))[1] == 0x7FC1


@pytest.mark.parametrize(
    "base",
    [None, torch.zeros(4, 6, dtype=torch.bfloat16), torch.zeros(6, 4, dtype=torch.float32)],
    ids=["no-copy", "other-shape", "other-dtype"],
)
def test_a_tensor_the_receiver_does_not_hold_in_its_layout_goes_whole(base):
    new = torch.randn(6, 4).to(torch.bfloat16)
    delta = encode_tensor(base, new)
    assert delta.indices is None and delta.values.numel() == new.numel()
    assert torch.equal(bits(decode_tensor("w", base, delta)), bits(new))


def test_a_tensor_whose_every_element_changed_goes_whole_as_that_is_fewer_bytes():
    base = torch.zeros(32, dtype=torch.bfloat16)
    delta = encode_tensor(base, torch.ones(32, dtype=torch.bfloat16))
    assert delta.indices is None and delta.nbytes() == 32 * 2


def test_a_receiver_whose_copy_is_not_the_base_is_refused_by_the_checksum():
    weights = adam_like_steps(2, 1e-5)
    delta = encode_tensor(weights[1], weights[2])  # taken against version 1
    with pytest.raises(WeightSyncError, match=r"layer\.weight differs from the sender's after applying"):
        decode_tensor("layer.weight", weights[0], delta)  # the receiver holds version 0


def test_changed_elements_for_a_receiver_without_a_copy_are_refused_by_name():
    base = torch.zeros(8, dtype=torch.bfloat16)
    new = base.clone()
    new[2] = 1.0
    with pytest.raises(
        WeightSyncError, match=r"lm_head\.weight came as changed elements, but this receiver holds no copy"
    ):
        decode_tensor("lm_head.weight", None, encode_tensor(base, new))
