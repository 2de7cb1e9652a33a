"""SGLang sampling seeds (sglang 0.5.23 reads `sampling_seed` only with
`enable_deterministic_inference`): with `rollout.enable_deterministic_inference` a resumed engine
samples exactly as the uninterrupted one; without it, it does not, and the engine warns. Runs the
real engine class against the contract double in a subprocess (the double must not be importable
as `sglang` in this process, where the availability check expects it missing)."""

import json
import os
import sys
from pathlib import Path

from process_group import run_in_own_session

TESTS = Path(__file__).resolve().parents[1]


def test_resumed_sglang_engine_samples_as_uninterrupted_only_when_deterministic(tmp_path):
    path = os.pathsep.join(str(p) for p in (TESTS.parent, TESTS / "doubles", TESTS / "megatron"))
    env = dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1")
    done = run_in_own_session(
        [sys.executable, str(TESTS / "rollout" / "_sglang_seeds.py"), str(tmp_path / "tiny")],
        env=env, timeout=600, cwd=TESTS.parent,
    )  # fmt: skip
    lines = [line for line in done.stdout.splitlines() if line.startswith("SEEDS ")]
    assert done.returncode == 0 and lines, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(lines[0].removeprefix("SEEDS "))
    assert report["True"] == {"resumed_equal": True, "calls_differ": True}, report
    assert report["False"] == {"resumed_equal": False, "calls_differ": True}, report
    assert "SGLang sampling is not reproducible" in done.stderr
