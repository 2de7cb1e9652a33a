"""The tiny LLaVA-shaped model (hybridflow/utils/tiny_vlm.py) on Megatron-Core's LLaVAModel against
transformers, one torchrun launch per TP size: logits and next-token log-probs within 1e-5 (fp32),
and the HF -> Megatron -> HF export bit for bit. The checks live in `_vlm_parity_worker.py`, which
prints one "VLM PARITY OK tp=.. rank=.." line per rank when all of them passed."""

import pytest
from launch import run_distributed

from hybridflow.utils.tiny_vlm import make_tiny_vlm


@pytest.fixture(scope="module")
def tiny_vlm(tmp_path_factory):
    return make_tiny_vlm(tmp_path_factory.mktemp("tiny_vlm"))


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_llava_logits_and_export_match_transformers(tiny_vlm, tmp_path, tp):
    output = run_distributed(
        "_vlm_parity_worker.py", tp, "--hf-dir", tiny_vlm, "--out-dir", tmp_path / "export", timeout=600
    )
    for rank in range(tp):
        line = f"VLM PARITY OK tp={tp} rank={rank}"
        assert line in output, f"missing {line!r} in:\n{output[-4000:]}"
