"""The shared-memory TP gather of the weight stream (engines/megatron/tp_staging.py) at TP2 over
gloo: bit for bit the checkpoint, then bit for bit the collective gather after an update (see
`_tp_staging_worker.py`)."""

import pytest
from launch import run_distributed
from tiny_hf import make_tiny_hf_checkpoint


@pytest.mark.slow
def test_staged_tp2_stream_equals_the_unsharded_weights(tmp_path):
    hf_dir = make_tiny_hf_checkpoint(tmp_path / "hf", arch="qwen2")
    output = run_distributed("_tp_staging_worker.py", 2, hf_dir, timeout=300)
    for check in ("staged", "staged-update"):
        for rank in (0, 1):
            assert f"OK {check} rank={rank}" in output, f"missing {check} on rank {rank}:\n{output[-4000:]}"
