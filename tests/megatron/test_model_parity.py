"""Megatron model vs transformers at (TP, PP) = (1,1), (2,1), (1,2), (2,2), one torchrun launch per world.

The checks themselves (logits, log-probs and entropies, gradients through the schedule, weight
round trip, export, value head) live in `_model_parity_worker.py`; each prints one
"PARITY OK <arch> tp=.. pp=.. rank=.." line per rank when every check passed.
"""

import pytest
from launch import run_distributed

ARCHS = ("qwen2", "llama")


@pytest.fixture(scope="module")
def work_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("megatron_parity")


def assert_all_passed(output: str, layouts: list[tuple[int, int]], world: int) -> None:
    for tp, pp in layouts:
        for arch in ARCHS:
            for rank in range(world):
                line = f"PARITY OK {arch} tp={tp} pp={pp} rank={rank}"
                assert line in output, f"missing {line!r} in:\n{output[-4000:]}"


@pytest.mark.slow
def test_parity_on_two_ranks_dp_tp_pp(work_dir):
    """World of 2: (1,1) with data parallelism 2, then (2,1), then (1,2)."""
    layouts = [(1, 1), (2, 1), (1, 2)]
    spec = ",".join(f"{tp}x{pp}" for tp, pp in layouts)
    output = run_distributed(
        "_model_parity_worker.py", 2, "--work-dir", work_dir, "--layouts", spec, timeout=400
    )
    assert_all_passed(output, layouts, world=2)


@pytest.mark.slow
def test_parity_on_four_ranks_tp2_pp2(work_dir):
    output = run_distributed(
        "_model_parity_worker.py", 4, "--work-dir", work_dir, "--layouts", "2x2", timeout=400
    )
    assert_all_passed(output, [(2, 2)], world=4)
