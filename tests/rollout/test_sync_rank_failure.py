"""A colocated weight sync (actor TP2 on 2 gloo processes, hf engines) in which one rank's engine
fails to load a bucket with a generic error (an out-of-memory error is a plain RuntimeError): every
rank's sync raises a WeightSyncError naming that rank and its error within the launch's deadline,
none is left waiting in the stream's collectives for the failed one."""

import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "megatron"))
from launch import run_distributed
from tiny_hf import ascii_vocab_size, make_tiny_hf_checkpoint

WORKER = Path(__file__).resolve().parent / "_sync_failure_worker.py"


@pytest.mark.slow
def test_a_generic_error_on_one_rank_stops_every_rank_naming_it(tmp_path):
    hf_dir = make_tiny_hf_checkpoint(tmp_path / "hf", arch="qwen2", vocab_size=ascii_vocab_size())
    output = run_distributed(WORKER, 2, hf_dir, timeout=300)
    for rank in (0, 1):
        line = re.search(rf"^RANK {rank} (.*)$", output, re.MULTILINE)
        assert line, f"rank {rank} reported nothing:\n{output[-4000:]}"
        assert line.group(1).startswith("WeightSyncError: weight sync on rank 1: bucket 0 ("), line.group(1)
        assert "RuntimeError: out of memory loading the bucket (test)" in line.group(1), line.group(1)
