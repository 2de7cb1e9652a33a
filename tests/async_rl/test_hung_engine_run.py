"""A rollout engine that hangs mid-run (trainer.placement=disaggregated, trainer.async_training.mode=
stream, the real vLLM CPU engine in one rollout process, through scripts/run_recipe.sh). The hang,
not a timing: the run's processes load hung_engine/sitecustomize.py, with which the first rollout
process to reach its HANG_AT-th decoding-step output blocks that step forever (its engine's loop
with it), the process itself alive.

Its group call passes rollout.engine_call_timeout_s, the engine's health check gets no answer
within rollout.engine_health_check_timeout_s, and the pool kills the process as hung. With no
restart left (rollout.max_engine_restarts=0) the run ends with exit status 1 and one `error:` line
naming the process and the call it hung in, no traceback, no process of the run left. (A hung
engine with a restart left is restarted as a dead one: tests/async_rl/test_hung_engines.py, whose
restart path the killed-engine runs of test_engine_restarts.py take on the real engine.)
"""

import os
import subprocess
import uuid
from pathlib import Path

import psutil
import pytest
from hung_engine.sitecustomize import HANG_AT_ENV, HANG_ENV
from multinode_helpers import processes_with_env
from run_processes import cleanup
from tiny_run import command, environment, tiny_run_inputs

pytestmark = pytest.mark.slow

HUNG_ENGINE = Path(__file__).parent / "hung_engine"  # on the run's path: its sitecustomize
HANG_AT = 70  # past the first step's 64 outputs at most (8 rows of 8 tokens): the run is under way
OVERRIDES = (
    "trainer.placement=disaggregated", "trainer.n_gpus_per_node=1",
    "actor.megatron.tensor_model_parallel_size=1", "trainer.rollout_pool.n_gpus_per_node=1",
    "rollout.name=vllm", "trainer.total_training_steps=3", "trainer.save_freq=0", "trainer.export_hf=false",
    "trainer.async_training.mode=stream", "trainer.async_training.max_staleness=1",
    "rollout.calculate_log_probs=true", "algorithm.rollout_correction.mode=decoupled_ppo",
    # a healthy engine's loop answers between two decoding steps: well within these on a busy CPU
    "rollout.engine_call_timeout_s=5", "rollout.engine_health_check_timeout_s=30",
)  # fmt: skip


@pytest.fixture(scope="module")
def local(tmp_path_factory) -> dict:
    return tiny_run_inputs(tmp_path_factory.mktemp("hung"))


def run(local: dict, out: Path, hang: Path, restarts: int) -> subprocess.CompletedProcess:
    """The run to its end, its output (stdout and stderr) as one text; every process of it gone."""
    hang.mkdir()
    marker = uuid.uuid4().hex
    env = environment(
        local, marker, **{HANG_ENV: str(hang), HANG_AT_ENV: str(HANG_AT)},
        PYTHONPATH=f"{HUNG_ENGINE}{os.pathsep}{local['root']}",
    )  # fmt: skip
    proc = subprocess.Popen(
        command(local, out, *OVERRIDES, f"rollout.max_engine_restarts={restarts}"),
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        output, _ = proc.communicate(timeout=900)
        assert processes_with_env(f"HYBRIDFLOW_TEST_RUN={marker}") == [], output[-4000:]
    finally:
        cleanup(proc, marker)
    return subprocess.CompletedProcess(proc.args, proc.returncode, output)


def hung_pid(hang: Path) -> int:
    """The process whose engine hung (it did hang: the claim was made)."""
    (hung,) = hang.glob("hung.*")
    return int(hung.name.split(".")[1])


def test_a_hung_engine_without_a_restart_left_ends_the_run_with_one_named_line(local, tmp_path):
    hang = tmp_path / "hang"
    done = run(local, tmp_path / "run", hang, restarts=0)
    assert done.returncode == 1, done.stdout[-4000:]
    assert "Traceback" not in done.stdout, done.stdout[-4000:]
    assert not psutil.pid_exists(hung_pid(hang))
    last = done.stdout.rstrip().splitlines()[-1]
    assert last == (
        "error: rollout pool process 0 hung in `generate_sequences` (trainer.rollout_pool): CallTimeout: "
        "rollout engine rank 0 did not answer `generate_sequences` within 5s nor its health check within "
        "30s (rollout.engine_call_timeout_s: raise it if the call is only slow); rerun the same command "
        "to resume from the last checkpoint"
    ), last
