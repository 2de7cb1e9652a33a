"""Run a worker script under `torchrun --nproc_per_node N` and fail loudly with its output.

`run_distributed(script, nproc, *args, timeout=300)` runs the script with the repo's Python
(OMP_NUM_THREADS=1; torchrun's rendezvous on a port of the OS's choice) and returns the combined
stdout+stderr on success; on a non-zero exit or timeout it raises `RuntimeError` carrying the
output's tail, so pytest shows which rank failed and why. torchrun runs in its own session and,
on a timeout or an exception (Ctrl-C included), is stopped with every worker it started
(tests/process_group.py): its workers run in sessions of their own and would outlive a plain
`subprocess.run` timeout.
"""

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from process_group import run_in_own_session

TESTS_MEGATRON_DIR = Path(__file__).resolve().parent
REPO_ROOT = TESTS_MEGATRON_DIR.parents[1]


def run_distributed(script, nproc: int, *args, timeout: float = 300, env: dict | None = None) -> str:
    """Run `script` (a path, or a file name in tests/megatron/) on `nproc` local processes."""
    script_path = Path(script)
    if not script_path.is_absolute() and not script_path.exists():
        script_path = TESTS_MEGATRON_DIR / script_path
    if not script_path.exists():
        raise ValueError(f"worker script not found: {script}")
    run_env = dict(os.environ)
    run_env.update({"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"})
    run_env["PYTHONPATH"] = os.pathsep.join(
        p for p in [str(REPO_ROOT), str(TESTS_MEGATRON_DIR), run_env.get("PYTHONPATH", "")] if p
    )
    run_env.update(env or {})
    # torchrun's agent keeps its records in a folder of its own: removed after (by default a new one
    # in /tmp each launch, left there)
    with tempfile.TemporaryDirectory(prefix="torchrun_") as log_dir:
        # --standalone: torchrun's rendezvous store binds port 0 and the workers get the port it bound
        # (a port found free and passed on could be taken by another process before the store binds it)
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
            "--nnodes", "1", "--log-dir", log_dir, str(script_path), *[str(a) for a in args],
        ]  # fmt: skip
        return _run(cmd, run_env, script_path, nproc, timeout)


def _run(cmd: list[str], run_env: dict, script_path: Path, nproc: int, timeout: float) -> str:
    try:
        proc = run_in_own_session(cmd, cwd=REPO_ROOT, env=run_env, timeout=timeout)
    except subprocess.TimeoutExpired as err:
        output = (err.stdout or "") + (err.stderr or "")
        raise RuntimeError(
            f"{script_path.name} x{nproc} timed out after {timeout}s:\n{output[-8000:]}"
        ) from err
    output = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise RuntimeError(f"{script_path.name} x{nproc} exited with {proc.returncode}:\n{output[-8000:]}")
    return output
