"""Actor (Megatron-Core, TP2 x PP2, then a Qwen3-MoE at TP2 x EP2, on 4 gloo processes) -> rollout
engines (hf, and SGLang through its contract double): one launch, nine checks.

See `_sync_worker.py` for what each check proves.
"""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "megatron"))
from launch import run_distributed
from tiny_hf import ascii_vocab_size, make_tiny_hf_checkpoint

WORKER = Path(__file__).resolve().parent / "_sync_worker.py"
CHECKS = (
    "sync-exact",
    "greedy-export",
    "independent",
    "sglang-cycle",
    "sglang-keep",
    "sglang-refused",
    "verify-catches",
    "dp2-chunks",
    "moe-tp2-ep2",
)


@pytest.mark.slow
def test_sync_from_tp2_pp2_actor(tmp_path):
    hf_dir = make_tiny_hf_checkpoint(tmp_path / "hf", arch="qwen2", vocab_size=ascii_vocab_size())
    moe_dir = make_tiny_hf_checkpoint(tmp_path / "moe", arch="qwen3_moe", vocab_size=ascii_vocab_size())
    output = run_distributed(WORKER, 4, hf_dir, tmp_path, moe_dir, timeout=500)
    for check in CHECKS:
        assert f"OK {check}" in output, f"check {check!r} did not pass:\n{output[-4000:]}"
