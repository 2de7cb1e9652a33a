"""The reward-model role at pipeline parallel 2: scores equal transformers' sequence classifier
on the exported model (the head read at each sequence's last real token), and the non-last
stage returns None. The checks run in `_rm_worker.py` under torchrun."""

import pytest
from launch import run_distributed
from tiny_hf import make_tiny_hf_checkpoint


@pytest.mark.slow
def test_reward_model_scores_match_transformers_at_pp2(tmp_path):
    hf_dir = make_tiny_hf_checkpoint(tmp_path / "rm", arch="qwen2", num_layers=2)
    output = run_distributed(
        "_rm_worker.py", 2, "--hf-dir", hf_dir, "--export-dir", tmp_path / "export", timeout=300
    )
    for rank in range(2):
        assert f"RM OK rank={rank}" in output, output[-4000:]
