"""A checkpoint save that fills the disk, for real: trainer.output_dir on a 12 MiB tmpfs, where
one checkpoint of the 2-layer tiny model (~7.5 MiB) fits and a second does not.

- the run ends with status 1 and one `error:` line naming the step, the partial directory, "No
  space left on device" with the free space, and the last complete checkpoint; no traceback, and
  the tracker's plots failing on the same full disk do not replace that line;
- global_step_1 stays complete (its manifest verifies) and `latest` names it;
- after the filesystem grows, the same command removes the stale `.tmp_global_step_2` with a line
  saying so, resumes from step 1 and finishes.

Needs `mount -t tmpfs` (root); skipped with the reason otherwise.
"""

import subprocess
import uuid
from pathlib import Path

import pytest
from process_group import run_in_own_session
from tiny_run import command, environment, tiny_run_inputs

from hybridflow.trainer.checkpoint import verify_checkpoint

pytestmark = pytest.mark.slow


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 12 MiB tmpfs mounted at tmp_path/out; yields (mount point, remount(size))."""
    mount_point = tmp_path / "out"
    mount_point.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=12m", "tmpfs", str(mount_point)], capture_output=True, text=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")

    def remount(size: str) -> None:
        subprocess.run(["mount", "-o", f"remount,size={size}", str(mount_point)], check=True)

    try:
        yield mount_point, remount
    finally:
        subprocess.run(["umount", "--lazy", str(mount_point)], check=False)


def run(local: dict, output_dir: Path) -> subprocess.CompletedProcess:
    plots = "trainer.logger=[console,plots]"  # the plots fail on the full disk too
    argv = command(local, output_dir, "trainer.total_training_steps=2", "trainer.save_freq=1", plots)
    return run_in_own_session(argv, env=environment(local, uuid.uuid4().hex), timeout=1200)


def test_a_full_disk_during_a_save_ends_with_one_line_and_the_last_checkpoint_resumes(tmp_path, small_tmpfs):
    mount_point, remount = small_tmpfs
    local = tiny_run_inputs(tmp_path / "inputs")
    checkpoints = mount_point / "run" / "checkpoints"

    result = run(local, mount_point / "run")
    assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    last = result.stderr.rstrip().splitlines()[-1]
    assert last.startswith(
        f"error: step 2: saving the checkpoint into {checkpoints / '.tmp_global_step_2'} failed: "
        "No space left on device ("
    ), last
    assert " free of 12.0 MiB there, a checkpoint needs about " in last
    assert f"the last complete checkpoint is {checkpoints / 'global_step_1'}, which a rerun resumes" in last
    assert len([line for line in result.stderr.splitlines() if line.startswith("error:")]) == 1
    assert verify_checkpoint(checkpoints / "global_step_1") == []
    assert (checkpoints / "latest").read_text().strip() == "global_step_1"
    assert (checkpoints / ".tmp_global_step_2").is_dir()

    remount("64m")
    rerun = run(local, mount_point / "run")
    assert rerun.returncode == 0, rerun.stdout[-2000:] + rerun.stderr[-3000:]
    assert (
        f"removed {checkpoints / '.tmp_global_step_2'}: a checkpoint save that did not finish" in rerun.stdout
    )
    assert f"resumed from {checkpoints / 'global_step_1'} at step 1" in rerun.stdout
    assert (checkpoints / "latest").read_text().strip() == "global_step_2"
    assert not list(checkpoints.glob(".tmp_*"))
