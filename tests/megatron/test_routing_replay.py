"""Routing replay (R3) between the hf engine and the Megatron actor on the tiny Qwen3-MoE and
Mixtral, at TP 1 with EP 1 (two data-parallel ranks) and EP 2: the engine's recorded experts equal
Megatron's router picks away from near-ties, and with replay the log-prob pass and the update's
forward use exactly the replayed experts (checks in _routing_replay_worker.py)."""

import pytest
from launch import run_distributed

from hybridflow.utils.tiny_model import MOE_ARCHS


@pytest.mark.slow
def test_recorded_experts_match_megatron_and_replay_is_exact(tmp_path):
    output = run_distributed("_routing_replay_worker.py", 2, "--work-dir", tmp_path, timeout=600)
    for ep in (1, 2):
        for arch in MOE_ARCHS:
            for rank in (0, 1):
                assert f"REPLAY OK {arch} ep={ep} rank={rank} " in output, output[-4000:]
    print("\n".join(line for line in output.splitlines() if line.startswith("REPLAY OK")))
