"""With top-p or top-k sampling, the rollout engine's log-probs and the actor's are of the same
distribution (the truncated one the engine sampled from, docs/sampling.md): one step of the
quickstart recipe on each engine (tests/_sampling_run.py, the one-process path, fp32 on both
sides, the same weights) logs both mismatch checks near 0. A log-prob over the whole vocabulary
on one side and over the kept tokens on the other would differ by log Z on every token (Z the
kept mass: about log 0.9 at top_p 0.9 on the tiny model's flat distribution, k3 about 5e-3). The
reference is filtered too: its KL to the policy is 0 before the first update."""

import json
import os
import sys
from pathlib import Path

import pytest
from process_group import run_in_own_session

pytestmark = pytest.mark.slow
SCRIPT = Path(__file__).with_name("_sampling_run.py")
SETTINGS = {
    "top_p": ["rollout.sampling.top_p=0.9"],
    "top_k": ["rollout.sampling.top_k=20"],
    "top_k_and_top_p": ["rollout.sampling.top_k=40", "rollout.sampling.top_p=0.8"],
}


def one_step(workdir: Path, engine: str, settings: list[str]) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    cmd = [sys.executable, str(SCRIPT), str(workdir), engine, *settings]
    done = run_in_own_session(cmd, env=env, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (record,) = [json.loads(line) for line in (workdir / "out" / "metrics.jsonl").read_text().splitlines()]
    return record


@pytest.mark.parametrize("setting", sorted(SETTINGS))
@pytest.mark.parametrize("engine", ["hf", "vllm"])
def test_engine_and_actor_log_probs_agree_under_truncated_sampling(tmp_path, engine, setting):
    record = one_step(tmp_path, engine, SETTINGS[setting])
    seen = {key: value for key, value in record.items() if key.startswith("mismatch/")}
    assert 0 <= record["mismatch/kl_k3"] < 1e-3, seen
    assert record["mismatch/log_prob_abs_diff_mean"] < 1e-2, seen
    # the engine's top-4 (tokens outside the kept set at -inf on both sides) against the actor's
    assert record["mismatch/top_k_kl_mean"] == pytest.approx(0.0, abs=1e-3), seen
    assert record["mismatch/top1_agreement"] > 0.9, seen
    # the reference is the initial policy, filtered alike: no KL before the first update
    assert record["kl/mean"] == pytest.approx(0.0, abs=1e-6), record["kl/mean"]
    assert record["actor/kl_loss"] == pytest.approx(0.0, abs=1e-6), record["actor/kl_loss"]
