"""Restarting a run whose worker process died (`trainer.restart_on_failure: N`).

In the colocated placement the rollout engines live in the actor's processes, so a process that
dies (killed, out of memory, a segfault in a kernel, a lost node) takes a shard of the weights and
the optimizer state with it: no single process can be restarted alone. The driver outlives it, so
main.py stops every worker group (their processes and slots), starts them again and resumes from
the newest complete checkpoint with the ordinary resume (`plan_resume`, `PPOTrainer.resume`), at
most N times a run. Only Ray's word that a process died counts (`dead_process`): an exception
raised by hybridflow's or the user's code, a bad recipe or a refused step would recur on every
restart, so they stop the run as before. With no restart left a dead process ends the run with one
`error:` line naming it (`WorkerProcessDied`), followed by what failed when the death failed a
checkpoint save.

Where a restart resumes from: the newest checkpoint this run has published (its `latest` file was
replaced since the run started); before the first, where the run itself started (its resume
point, or step 0 with the driver's random state as it was then).
"""

import dataclasses
import re
from pathlib import Path

from hybridflow.config.schema import RecipeConfig
from hybridflow.single_controller.errors import WorkerError
from hybridflow.trainer.checkpoint import LATEST, CheckpointSaveError, capture_rng_state, restore_rng_state
from hybridflow.trainer.resume import ResumePlan, plan_resume
from hybridflow.utils.imports import first_line


class WorkerProcessDied(RuntimeError):
    """A worker process died and no restart was left; the last complete checkpoint stays."""


def error_chain(err: BaseException) -> list[BaseException]:
    """`err`, then what it was raised from (a WorkerError's cause, else `__cause__`), to the root."""
    chain: list[BaseException] = []
    while err is not None and all(err is not seen for seen in chain):
        chain.append(err)
        err = err.cause if isinstance(err, WorkerError) else err.__cause__
    return chain


def dead_process(err: BaseException) -> BaseException | None:
    """Ray's error saying a worker process died, in `err` or what it was raised from (a failed
    checkpoint save, a rollout call); None when no process died. An actor whose constructor
    raised is not a death: that error would recur."""
    import ray.exceptions  # only a Ray run gets here

    for cause in error_chain(err):
        if isinstance(cause, WorkerError):  # also of its cause's type: Ray's own error comes next
            continue
        if isinstance(cause, ray.exceptions.RayActorError) and not cause.actor_init_failed:
            return cause
        if isinstance(cause, ray.exceptions.WorkerCrashedError | ray.exceptions.NodeDiedError):
            return cause
    return None


def describe_death(err: BaseException) -> str:
    """`worker rank 0 (HybridPolicyWorker, pid 4242) died during `policy_update_actor``, from the
    WorkerError (rank, method) and Ray's text (class, pid) in `err`'s chain."""
    text = str(dead_process(err) or err)
    found = [re.search(r"class_name: (\S+)", text), re.search(r"\bpid: (\d+)", text)]
    names = ", ".join(f"{label}{m.group(1)}" for label, m in zip(("", "pid "), found, strict=True) if m)
    call = next((e for e in error_chain(err) if isinstance(e, WorkerError)), None)
    who = "worker" + (f" rank {call.rank}" if call else "") + (f" ({names})" if names else "")
    return who + " died" + (f" during `{call.method}`" if call else "")


def is_worker_call_error(err: BaseException) -> bool:
    """A worker-group call's error or Ray's own, not an error of ours raised from one (a failed
    checkpoint save, a rollout pool call), whose message says what failed already."""
    import ray.exceptions

    return isinstance(err, WorkerError | ray.exceptions.RayError)


class Restarts:
    """The restarts a run has left (`trainer.restart_on_failure`) and where each resumes from."""

    def __init__(self, cfg: RecipeConfig, first_plan: ResumePlan | None):
        self.cfg, self.first_plan = cfg, first_plan
        self.allowed, self.done = cfg.trainer.restart_on_failure, 0
        self.latest_at_start = latest_marker(cfg)
        self.driver_rng = capture_rng_state()  # a restart from step 0 draws as the run did

    def take(self, err: BaseException) -> bool:
        """Whether `err` restarts the run (a process died and a restart is left); counts it."""
        if self.done >= self.allowed or dead_process(err) is None:
            return False
        self.done += 1
        return True

    def after(self, err: Exception) -> ResumePlan | None:
        """The plan to restart from after `err` stopped the workers; raises what the run stops with
        when `err` is no process's death or no restart is left."""
        if self.take(err):
            return self.resume_plan(err)
        died = dead_process(err)
        failed_save = isinstance(err, CheckpointSaveError)
        if died is None or not (is_worker_call_error(err) or failed_save):
            raise err
        spent = f"after {self.done} restart(s), " if self.done else ""
        hint = "" if self.allowed else "; trainer.restart_on_failure=N restarts it by itself"
        if failed_save:  # its message says which save failed and where a rerun resumes from
            what = f"{spent}{err}"
        else:
            stops = "the run stops: rerun the same command to resume from the last checkpoint"
            what = f"{first_line(died).rstrip('.')}; {spent}{stops}"
        raise WorkerProcessDied(f"{describe_death(err)}: {what}{hint}") from err

    def resume_plan(self, err: BaseException) -> ResumePlan | None:
        """The plan of the restart `take(err)` granted, announced on the console."""
        published = latest_marker(self.cfg) != self.latest_at_start
        plan = plan_resume(auto_resume(self.cfg)) if published else self.first_plan
        if plan is None:
            restore_rng_state(self.driver_rng)
        print(
            f"restart {self.done} of {self.allowed}: {describe_death(err)}; the workers were stopped, "
            f"starting them again and resuming {resumes_from(plan)}",
            flush=True,
        )
        return plan


def resumes_from(plan: ResumePlan | None) -> str:
    if plan is None:
        return "from the start (step 0): there is no checkpoint yet"
    return f"from {plan.point.path} (step {plan.point.step})"


def latest_marker(cfg: RecipeConfig) -> tuple[int, int] | None:
    """Identity of <output_dir>/checkpoints/latest (inode, mtime): every published checkpoint
    replaces the file, so a change means this run published one."""
    try:
        stat = (Path(cfg.trainer.output_dir) / "checkpoints" / LATEST).stat()
    except FileNotFoundError:
        return None
    return stat.st_ino, stat.st_mtime_ns


def auto_resume(cfg: RecipeConfig) -> RecipeConfig:
    """`cfg` resuming from the newest complete checkpoint, whatever it says (this run's own)."""
    trainer = dataclasses.replace(cfg.trainer, resume_mode="auto", resume_from_path=None)
    return dataclasses.replace(cfg, trainer=trainer)
