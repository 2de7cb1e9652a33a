"""trainer.mismatch_policy=stop ends a run whose rollout engine got corrupted weights, end to end on
the one-process path (tests/_mismatch_stop_run.py: LocalWorkerGroup, Megatron actor, hf engine,
PPOTrainer.fit): step 1, with the real sync, trains and logs the monitor's metrics near 0; step 2,
whose engine then loads noised weights through its own update_weights, stops with one `error:`
line naming the metric and the step, before its update (the policy's version stays 1) and with
no checkpoint of step 2."""

import json
import os
import sys
from pathlib import Path

import pytest
from process_group import run_in_own_session

pytestmark = pytest.mark.slow
SCRIPT = Path(__file__).with_name("_mismatch_stop_run.py")


def test_a_corrupted_engine_stops_the_run_before_the_update(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    done = run_in_own_session([sys.executable, str(SCRIPT), str(tmp_path)], env=env, timeout=600)
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]  # main()'s status for a stop
    last = done.stderr.rstrip().splitlines()[-1]
    assert last.startswith("error: step 2: mismatch/kl_k3 is "), done.stderr[-3000:]
    assert ", over trainer.mismatch_threshold=0.1: the rollout engine's log-probs" in last
    assert float(last.split("mismatch/kl_k3 is ")[1].split(",")[0]) > 1.0
    assert done.stdout.rstrip().splitlines()[-1] == "policy version 1"  # step 1's update only
    out = tmp_path / "out"
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [record["step"] for record in records] == [1]
    assert 0 <= records[0]["mismatch/kl_k3"] < 1e-4  # the same weights, fp32 on both sides
    assert records[0]["mismatch/log_prob_abs_diff_max"] < 1e-2
    assert sorted(p.name for p in (out / "checkpoints").glob("global_step_*")) == ["global_step_1"]
    assert (out / "plots" / "mismatch.png").is_file()
