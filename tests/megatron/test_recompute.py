"""Activation recompute on CPU ranks (Megatron-Core's checkpointing over gloo, PP 2, 1F1B): the
same loss and gradients as without recompute on a dense model and, with routing replay, on an MoE
model (each micro-batch's recompute replays its own routes); and the router's load-balancing loss
does not count padding positions. Checks in _recompute_worker.py."""

import pytest
from launch import run_distributed

CHECKS = ("dense", "replay", "aux")


@pytest.mark.slow
@pytest.mark.parametrize("check", CHECKS)
def test_recompute_at_pp2(tmp_path, check):
    output = run_distributed(
        "_recompute_worker.py", 2, "--work-dir", tmp_path, "--checks", check, timeout=600
    )
    for rank in (0, 1):
        assert f"RECOMPUTE OK {check} rank={rank}" in output, output[-4000:]
