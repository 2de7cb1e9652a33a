"""scripts/slurm/run_recipe.sbatch on a real one-node Slurm cluster (Debian's slurm-wlm + munge,
started by scripts/slurm/setup_local_cluster.sh): Ray head via srun, join wait, the tiny recipe
through scripts/run_recipe.sh, and teardown of everything the job started.

Needs root, or Slurm already installed; skipped (with the reason) only where the packages cannot
be installed. The daemons the fixture started are stopped by pid when the session ends.
"""

import json
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
import yaml
from multinode_helpers import TOTAL_STEPS, assert_nothing_left, write_tiny_recipe

ROOT = Path(__file__).resolve().parents[1]
SETUP = ROOT / "scripts" / "slurm" / "setup_local_cluster.sh"
SBATCH_SCRIPT = ROOT / "scripts" / "slurm" / "run_recipe.sbatch"
CANNOT_INSTALL = 3  # setup_local_cluster.sh's exit status when slurm-wlm/munge cannot be installed

pytestmark = pytest.mark.slow


@pytest.fixture(scope="session")
def slurm_env(tmp_path_factory):
    """Environment for sbatch against a one-node cluster of the session's own (state directory
    and ports apart from any other Slurm on the machine)."""
    env = dict(
        os.environ,
        HYBRIDFLOW_SLURM_DIR=str(tmp_path_factory.mktemp("slurm_cluster")),
        HYBRIDFLOW_SLURMCTLD_PORT="16827",
        HYBRIDFLOW_SLURMD_PORT="16828",
    )
    started = subprocess.run(
        ["bash", str(SETUP), "start"], env=env, capture_output=True, text=True, timeout=900
    )
    try:
        if started.returncode == CANNOT_INSTALL:
            pytest.skip(f"Slurm cannot be installed on this machine: {started.stderr.strip()[-500:]}")
        assert started.returncode == 0, started.stdout + started.stderr
        conf = re.search(r"^SLURM_CONF=(.+)$", started.stdout, re.MULTILINE)
        assert conf, started.stdout
        env["SLURM_CONF"] = conf.group(1)
        yield env
    finally:
        subprocess.run(["bash", str(SETUP), "teardown"], env=env, timeout=120, check=False)


def sbatch_wait(env: dict, output: Path, *args: str, extra_env: dict | None = None, timeout: int = 420):
    """`sbatch --wait` the launch script from the repository root; (exit status, job id, job output)."""
    done = subprocess.run(
        ["sbatch", "--wait", "--parsable", f"--output={output}", str(SBATCH_SCRIPT), *args],
        cwd=ROOT,
        env={**env, **(extra_env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    job_id = done.stdout.strip().split(";")[0]
    text = output.read_text() if output.exists() else ""
    return done.returncode, job_id, text + done.stderr


@pytest.fixture
def job_dirs():
    """Short scratch directory (Ray's socket paths live under it) removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix="hfs", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_sbatch_runs_the_tiny_recipe_on_ray_started_by_slurm(slurm_env, tmp_path, job_dirs):
    recipe = write_tiny_recipe(tmp_path, tmp_path / "run")
    token = "a" * 63 + "1"
    status, job_id, output = sbatch_wait(
        slurm_env,
        tmp_path / "job.out",
        str(recipe),
        "trainer.experiment_name=slurm",
        extra_env={
            "RAY_AUTH_TOKEN": token,
            "HYBRIDFLOW_RAY_TMPDIR": str(job_dirs),
            "HYBRIDFLOW_RAY_LOG_DIR": str(tmp_path / "ray_logs"),
        },
    )
    assert status == 0, output[-4000:]
    # the head's GCS bound a port of its own (none was picked for it) and the job joined it there
    head_address = (job_dirs / f"hybridflow-ray-{job_id}" / "ray_current_cluster").read_text()
    assert f"all 1 node(s) joined the Ray cluster at {head_address}" in output
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, TOTAL_STEPS + 1))
    assert all("actor/pg_loss" in m for m in metrics)
    resolved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["trainer"]
    # CPU-only allocation of one node: shape from the allocation, one process per node by default.
    assert (resolved["nnodes"], resolved["n_gpus_per_node"], resolved["use_gpu"]) == (1, 1, False)
    assert resolved["experiment_name"] == "slurm"
    head_log = (tmp_path / "ray_logs" / f"ray-{os.uname().nodename.split('.')[0]}.log").read_text()
    # Ray got every CPU of the node (the whole node is allocated) and no GPU.
    assert f"{len(os.sched_getaffinity(0))} CPU, 0 GPU" in head_log
    assert (job_dirs / f"hybridflow-ray-{job_id}").is_dir()  # Ray ran with the job's session dir
    assert_nothing_left(token)


def test_sbatch_rejects_shape_overrides_before_starting_ray(slurm_env, tmp_path):
    recipe = write_tiny_recipe(tmp_path, tmp_path / "run")
    status, _, output = sbatch_wait(slurm_env, tmp_path / "job.out", str(recipe), "trainer.nnodes=2")
    assert status == 2
    assert "'trainer.nnodes=2' is set from the allocation" in output
    assert "Ray head" not in output


def test_failed_run_names_missing_cpus_and_still_tears_ray_down(slurm_env, tmp_path, job_dirs):
    # One more worker process than the node has CPUs: the trainer's cluster check stops the run
    # before any worker starts, and the trap must still stop the Ray the job started.
    cpus = len(os.sched_getaffinity(0))
    recipe = write_tiny_recipe(tmp_path, tmp_path / "run")
    token = "b" * 63 + "2"
    # Batch sizes that split over cpus + 1 data-parallel ranks, so the recipe itself is valid.
    batch = [f"data.train_batch_size={cpus + 1}", f"actor.update.ppo_mini_batch_size={2 * (cpus + 1)}"]
    status, _, output = sbatch_wait(
        slurm_env,
        tmp_path / "job.out",
        str(recipe),
        *batch,
        extra_env={
            "RAY_AUTH_TOKEN": token,
            "HYBRIDFLOW_PROCS_PER_NODE": str(cpus + 1),
            "HYBRIDFLOW_RAY_TMPDIR": str(job_dirs),
            "HYBRIDFLOW_RAY_LOG_DIR": str(tmp_path / "ray_logs"),
        },
    )
    assert status == 2, output[-4000:]
    assert f"trainer.n_gpus_per_node={cpus + 1}, trainer.use_gpu=false need 1 node(s)" in output
    assert "lacks 1 CPU" in output
    assert "stopping Ray on 1 node(s)" in output
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    assert_nothing_left(token)
