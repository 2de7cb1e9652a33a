"""The GPU-path audit checks that need the real sharding manager over several ranks (D5, D6, D8):
actor TP2 on 2 gloo processes, SGLang rollout TP2 through its contract double. See
`_audit_worker.py` for what each check proves."""

from pathlib import Path

import pytest
from launch import run_distributed
from tiny_hf import ascii_vocab_size, make_tiny_hf_checkpoint

WORKER = Path(__file__).resolve().parent / "_audit_worker.py"
CHECKS = ("process-env", "stream-mismatch", "hook-order", "load-before-generate")


@pytest.mark.slow
def test_sharding_manager_audit_on_two_ranks(tmp_path):
    hf_dir = make_tiny_hf_checkpoint(tmp_path / "hf", vocab_size=ascii_vocab_size())
    narrow_dir = make_tiny_hf_checkpoint(
        tmp_path / "narrow", vocab_size=ascii_vocab_size(), intermediate_size=96
    )
    output = run_distributed(WORKER, 2, hf_dir, narrow_dir, timeout=300)
    for check in CHECKS:
        assert f"OK {check}" in output, f"check {check!r} did not pass:\n{output[-4000:]}"
