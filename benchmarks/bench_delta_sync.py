"""Delta weight sync (`rollout.weight_sync_delta`): bytes against a full sync, seconds, bit-identity.

The 76M Qwen2 shape of bench_vllm (hidden 768, 12 layers) as fp32 master weights, trained by Adam
on a language-model loss over a tiny random batch (BATCH sequences of SEQ tokens: real gradients,
cheap), at lr 1e-6 and 1e-5. The rollout holds bf16 weights, so a sync's deltas are taken in bf16
(engines/weight_sync/delta.py, what the transfer runs): after 1, 10 and 50 updates, two syncs are
measured, one to a receiver that holds the previous update's weights (a sync after every update)
and one to a receiver that holds the weights before the first update (a receiver that many
updates behind, as with sync_every). For each: the bytes a full sync sends (every tensor in bf16),
the bytes the delta sends (positions or bitmasks, and values), the share of elements changed, the
seconds to encode every tensor (the sender: cast, compare, gather, checksum) and to decode it (the
receiver: apply, checksum check), and whether the receiver's tensors are bit-identical to a full
sync's (every tensor's bits equal to those of the bf16 cast of the master weights).

Run: `python -m benchmarks delta_sync` (a few minutes on 2 cores).
"""

import tempfile
import time
from pathlib import Path

TITLE = "Delta weight sync: bytes against a full sync, seconds and bit-identity (76M, bf16, Adam)"
LRS = (1e-6, 1e-5)
CHECKPOINTS = (1, 10, 50)  # updates after which a sync is measured
BATCH, SEQ = 2, 16  # the tiny random batch of every update
MIB = 1024 * 1024


def run() -> list[dict]:
    import torch

    from benchmarks.bench_vllm import SHAPE_76M, _make_model

    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = _make_model(Path(tmp) / "m76", **SHAPE_76M)
        return [row for lr in LRS for row in _lr_rows(model_dir, lr)]


def _lr_rows(model_dir: Path, lr: float) -> list[dict]:
    """The rows of one learning rate: both syncs after each of CHECKPOINTS updates."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr, fused=True)  # fused: the CPU kernel, fastest
    gen = torch.Generator().manual_seed(0)
    batch = torch.randint(0, model.config.vocab_size, (BATCH, SEQ), generator=gen)  # (B, T)
    first = previous = _bf16_weights(model)
    rows = []
    for update in range(1, max(CHECKPOINTS) + 1):
        optimizer.zero_grad()
        model(input_ids=batch, labels=batch).loss.backward()
        optimizer.step()
        if update in CHECKPOINTS:
            current = _bf16_weights(model)
            rows.append(_sync_row(lr, update, "previous update", previous, current))
            if update > 1:  # after one update, the previous update's weights are those before it
                rows.append(_sync_row(lr, update, "before update 1", first, current))
            previous = current
        elif update + 1 in CHECKPOINTS:
            previous = _bf16_weights(model)
    return rows


def _bf16_weights(model) -> dict:
    """The model's tensors under their HF names in bf16: what the rollout holds after a full sync."""
    import torch

    from engines.rollout.hf_rollout import checkpoint_tensors

    return {name: t.detach().to(torch.bfloat16, copy=True) for name, t in checkpoint_tensors(model).items()}


def _sync_row(lr: float, updates: int, holds: str, base: dict, new: dict) -> dict:
    """One delta sync from `base` (what the receiver holds) to `new`, measured."""
    import torch

    from engines.weight_sync.delta import DeltaBase, DeltaStats, bits

    sender, receiver = DeltaBase(torch.bfloat16, dict(base)), DeltaBase(torch.bfloat16, dict(base))
    start = time.perf_counter()
    deltas = [(name, sender.encode(name, tensor, against_base=True)) for name, tensor in new.items()]
    encoded = time.perf_counter()
    received = {name: receiver.decode(name, delta) for name, delta in deltas}
    decoded = time.perf_counter()
    stats = DeltaStats()
    for _, delta in deltas:
        stats.add(delta)
    identical = all(torch.equal(bits(received[name]), bits(t)) for name, t in new.items())
    return {
        "lr": f"{lr:g}",
        "updates": updates,
        "receiver holds": holds,
        "full sync MiB": stats.full_bytes / MIB,
        "delta MiB": stats.sent_bytes / MIB,
        "delta / full": stats.sent_bytes / stats.full_bytes,
        "changed elements": stats.changed / stats.elements,
        "encode s": encoded - start,
        "decode s": decoded - encoded,
        "bit-identical": "yes" if identical else "NO",
    }
