"""Megatron model vs transformers, one torchrun launch per world size.

Layouts TPxPP(xEP): (1,1), (2,1), (1,2) and EP 2 with each MoE token dispatcher (all-gather,
all-to-all) on two ranks; (2,2) and TP 2 x EP 2 (all-to-all) on four. Every layout runs every
tiny model (Qwen2, Llama, Qwen3, Qwen3-MoE, Mixtral); EP > 1 runs the mixture-of-experts models
only. The checks themselves (logits, log-probs and entropies,
gradients through the schedule, weight round trip, export, value head) live in
`_model_parity_worker.py`; each prints one "PARITY OK <arch> tp=.. pp=.. ep=.. rank=.." line per
rank (plus the dispatcher when EP > 1) when every check passed.
"""

import pytest
from launch import run_distributed

ARCHS = ("qwen2", "llama", "qwen3", "qwen3_moe", "mixtral")
MOE_ARCHS = ("qwen3_moe", "mixtral")


@pytest.fixture(scope="module")
def work_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("megatron_parity")


def assert_all_passed(output: str, layouts: list[tuple], world: int) -> None:
    for tp, pp, ep, *dispatcher in layouts:
        dispatch = f" {dispatcher[0] if dispatcher else 'allgather'}" if ep > 1 else ""
        for arch in ARCHS if ep == 1 else MOE_ARCHS:
            for rank in range(world):
                line = f"PARITY OK {arch} tp={tp} pp={pp} ep={ep}{dispatch} rank={rank}"
                assert line in output, f"missing {line!r} in:\n{output[-4000:]}"


def run_layouts(work_dir, world: int, layouts: list[tuple]) -> None:
    """`layouts`: (tp, pp, ep) or (tp, pp, ep, MoE token dispatcher)."""
    spec = ",".join(f"{tp}x{pp}x{ep}" + "".join(f":{d}" for d in rest) for tp, pp, ep, *rest in layouts)
    output = run_distributed(
        "_model_parity_worker.py", world, "--work-dir", work_dir, "--layouts", spec, timeout=900
    )
    assert_all_passed(output, layouts, world)


@pytest.mark.slow
def test_parity_on_two_ranks_dp_tp_pp_ep(work_dir):
    """World of 2: (1,1) with data parallelism 2, then (2,1), (1,2), and EP 2 (experts split)."""
    run_layouts(work_dir, 2, [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2), (1, 1, 2, "alltoall")])


@pytest.mark.slow
def test_parity_on_four_ranks_tp2_pp2_and_tp2_ep2(work_dir):
    run_layouts(work_dir, 4, [(2, 2, 1), (2, 1, 2, "alltoall")])
