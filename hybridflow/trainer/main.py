"""Entry point: run a recipe.

    python -m hybridflow.trainer.main recipes/gsm8k_grpo.yaml [key.path=value ...]
    bash scripts/run_recipe.sh recipes/gsm8k_grpo.yaml [key.path=value ...]     # the same

The recipe is loaded and checked before anything starts: `validate_recipe` (every key, the engine
validators, each model's config.json) and `check_run_inputs` (weights headers, tokenizer, prompt
data, resume point), then `plan_resume` (a recipe change the checkpoint cannot continue under). A
bad recipe or input exits with status 2 and one line per problem, no traceback, and writes
nothing. Then the resolved recipe goes to <output_dir>/config.yaml, an earlier run's unfinished
checkpoint save is removed (said so on the console), and the trainer joins a Ray cluster
(RAY_ADDRESS, or one already running on this machine; RAY_ADDRESS=local forces a fresh one) or
starts a local one sized to the machine, and runs. A run that stops on a non-finite number, a
refused update, a train-inference mismatch under trainer.mismatch_policy=stop, a failing reward
function or a failed checkpoint save ends with one `error:` line and status 1; so does a worker
process that dies, unless trainer.restart_on_failure allows a restart: the workers then stop and
start again from the newest checkpoint (hybridflow/trainer/restart.py).
"""

import argparse
import os
import signal
import sys
from pathlib import Path

from hybridflow.checks.layout import Layout
from hybridflow.checks.recipe import check_run_inputs, validate_recipe
from hybridflow.checks.resume import warn_if_restarts_start_over
from hybridflow.config.loader import load_recipe, write_resolved_recipe
from hybridflow.config.models import resolve_recipe_models
from hybridflow.config.schema import RecipeConfig
from hybridflow.launch.local_ray import start_local_ray
from hybridflow.reward.manager import RewardFunctionError
from hybridflow.single_controller.errors import CallTimeout
from hybridflow.trainer.checkpoint import CheckpointManager, CheckpointSaveError
from hybridflow.trainer.datasets import with_generated_data
from hybridflow.trainer.mismatch import TrainInferenceMismatchError
from hybridflow.trainer.restart import Restarts, WorkerProcessDied
from hybridflow.trainer.resume import ResumePlan, plan_resume
from hybridflow.trainer.rollout.pool import RolloutProcessDied
from hybridflow.utils import warning_filters
from hybridflow.utils.nonfinite import StepRefusedError
from hybridflow.utils.teardown import closing_after

# Errors a run stops with whose message says everything (step, cause, what to do): one line, status 1.
RUN_STOPPING_ERRORS = (
    CallTimeout,
    StepRefusedError,
    CheckpointSaveError,
    RewardFunctionError,
    RolloutProcessDied,
    TrainInferenceMismatchError,
    WorkerProcessDied,
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m hybridflow.trainer.main",
        description="Run a hybridflow recipe (PPO / GRPO and the other advantage estimators).",
        epilog="example: python -m hybridflow.trainer.main recipes/gsm8k_grpo.yaml "
        "trainer.total_training_steps=10 data.train_files=[data/gsm8k/train.parquet]",
    )
    parser.add_argument("recipe", help="path of the YAML recipe")
    parser.add_argument("overrides", nargs="*", help="key.path=value settings applied over the recipe")
    return parser.parse_args(argv)


def connect_ray(cfg: RecipeConfig) -> None:
    """Join RAY_ADDRESS or the cluster running on this machine, else (or with RAY_ADDRESS=local)
    start one for this run, with a logical CPU for each of its worker processes."""
    import ray

    if ray.is_initialized():
        return
    # A failed worker-group call raises its first rank's error here (one `error:` line); the other
    # ranks' errors of that call, never fetched, would otherwise be dumped by Ray as "Unhandled
    # error" tracebacks after it, when the process exits.
    os.environ.setdefault("RAY_IGNORE_UNHANDLED_ERRORS", "1")
    address = os.environ.get("RAY_ADDRESS")
    if address and address != "local":
        ray.init(address=address, include_dashboard=False, configure_logging=False)
        return
    if not address and joined_running_cluster():
        return
    devices = cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node
    if cfg.trainer.placement == "disaggregated":
        devices += cfg.trainer.rollout_pool.nnodes * cfg.trainer.rollout_pool.n_gpus_per_node
    # Logical CPUs: one per worker process even on a machine with fewer cores.
    start_local_ray(num_cpus=max(os.cpu_count() or 1, devices + 1))


def joined_running_cluster() -> bool:
    """Whether a Ray cluster runs on this machine (then this driver joined it)."""
    import ray

    try:
        ray.init(address="auto", configure_logging=False)
        return True
    except ConnectionError as err:  # several clusters running is ambiguous: that error stands
        if "Could not find any running Ray instance" not in str(err):
            raise
        return False


def prepare(argv: list[str] | None) -> tuple[RecipeConfig, Layout]:
    """Load, check and record the recipe; nothing has started yet."""
    cfg, layout = checked_recipe(argv)
    record(cfg)
    return cfg, layout


def checked_recipe(argv: list[str] | None) -> tuple[RecipeConfig, Layout]:
    """The recipe of the command line, loaded and checked with the files it names."""
    args = parse_args(argv)
    cfg = load_recipe(args.recipe, args.overrides)
    cfg = resolve_recipe_models(cfg)
    layout = validate_recipe(cfg)
    cfg = with_generated_data(cfg)  # data.source's prompts, written as the files check_run_inputs reads
    check_run_inputs(cfg)
    warn_if_restarts_start_over(cfg)
    return cfg, layout


def record(cfg: RecipeConfig) -> None:
    """The resolved recipe into <output_dir>/config.yaml; an earlier run's unfinished save removed."""
    write_resolved_recipe(cfg, cfg.trainer.output_dir)
    remove_partial_saves(cfg)


def remove_partial_saves(cfg: RecipeConfig) -> None:
    """An earlier run's unfinished checkpoint save (never resumed from) goes, with a line saying so."""
    for path in CheckpointManager(Path(cfg.trainer.output_dir) / "checkpoints").remove_partial_saves():
        print(f"removed {path}: a checkpoint save that did not finish (an earlier run stopped during it)")


def connect_and_check_cluster(cfg: RecipeConfig) -> None:
    """Connect to Ray and check it can place every worker process, the rollout pool's too (a
    ValueError names what is missing and the keys that ask for it)."""
    from hybridflow.launch.cluster import check_cluster_resources

    connect_ray(cfg)
    install_stop_handlers()  # again: ray.init replaced the SIGTERM handler
    trainer, pool = cfg.trainer, cfg.trainer.rollout_pool
    disaggregated = trainer.placement == "disaggregated" and trainer.mode == "rl"
    rollout_pool = (pool.nnodes, pool.n_gpus_per_node) if disaggregated else None
    check_cluster_resources(
        trainer.nnodes, trainer.n_gpus_per_node, trainer.use_gpu, rollout_pool=rollout_pool
    )


def run(cfg: RecipeConfig, layout: Layout, resume_plan: ResumePlan | None) -> None:
    """Start the roles on the connected cluster and train (resuming as `resume_plan` says). When a
    worker process dies, the workers stop and start again from the newest checkpoint, up to
    trainer.restart_on_failure times (hybridflow/trainer/restart.py)."""
    from hybridflow.trainer.roles import start_roles

    restarts, plan = Restarts(cfg, resume_plan), resume_plan
    while True:
        roles = start_roles(cfg)  # not restarted when it fails: a failure to start would recur
        try:
            with closing_after("stopping the workers", roles.shutdown):
                trainer = trainer_class(cfg)(cfg, roles, actor_dp=layout.actor_dp, restarts=restarts.done)
                trainer.fit(plan)
            return
        except Exception as err:
            plan = restarts.after(err)  # or the error the run stops with
            remove_partial_saves(cfg)  # a save the dead process interrupted


def trainer_class(cfg: RecipeConfig) -> type:
    if cfg.trainer.mode == "sft":
        from hybridflow.trainer.sft import SFTTrainer

        return SFTTrainer
    from hybridflow.trainer.ppo_trainer import PPOTrainer

    return PPOTrainer


def main(argv: list[str] | None = None) -> int:
    warning_filters.install()
    # a connection the caller made (an in-process call) is the caller's to close
    disconnect = disconnect_ray if not ray_is_connected() else lambda: None
    try:
        cfg, layout = checked_recipe(argv)
        resume_plan = plan_resume(cfg)  # a bad checkpoint or refused change: before anything is written
        record(cfg)
        connect_and_check_cluster(cfg)
    except (ValueError, TypeError, OSError) as err:
        disconnect()
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        disconnect()
        return interrupted()
    try:
        with closing_after("disconnecting from Ray", disconnect):
            run(cfg, layout, resume_plan)
    except KeyboardInterrupt:
        return interrupted()
    except RUN_STOPPING_ERRORS as err:
        return stopped(err)
    return 0


def ray_is_connected() -> bool:
    ray = sys.modules.get("ray")  # not imported: not connected (and no import just to ask)
    return ray is not None and ray.is_initialized()


def disconnect_ray() -> None:
    """ray.shutdown() now, before the run's last line: Ray forwards its daemons' log lines to the
    driver until it disconnects (e.g. the GCS failing to reach actors being killed), and at exit
    they would come after that line."""
    import ray

    if ray.is_initialized():
        ray.shutdown()


def stopped(err: Exception) -> int:
    """One `error:` line, after the user's own traceback when their reward function raised (theirs
    to debug; hybridflow's frames around it are not shown); status 1."""
    user_traceback = getattr(err, "user_traceback", "")
    if user_traceback:
        print(user_traceback, end="", file=sys.stderr)
    print(f"error: {err}", file=sys.stderr)
    return 1


class StopSignal:
    """The signal that stopped the run. The handler raises KeyboardInterrupt for SIGTERM too: Ray's
    waits turn a KeyboardInterrupt raised inside them into their own plain one, and any other
    exception into a SystemError, so the exception alone cannot say which signal it was."""

    received = signal.SIGINT


def stop_like_ctrl_c(signum: int, frame) -> None:
    StopSignal.received = signal.Signals(signum)
    raise KeyboardInterrupt


def install_stop_handlers() -> None:
    """SIGINT and SIGTERM (a scheduler's or `timeout`'s stop) end the run alike: the teardown, one
    line, the shell's status for the signal. Installed again after ray.init, which sets a SIGTERM
    handler of its own (sys.exit(15)) and whose core worker adds a crash handler that prints a
    native stack dump for SIGTERM and sometimes aborts the process."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, stop_like_ctrl_c)


def interrupted() -> int:
    """SIGINT / SIGTERM: one line and the shell's status for it; the last complete checkpoint stays."""
    sig = StopSignal.received
    print(
        f"interrupted ({sig.name}): rerun the same command to resume from the last checkpoint",
        file=sys.stderr,
    )
    return 128 + sig


if __name__ == "__main__":
    # run_recipe.sh starts the driver as a background job, which begins with SIGINT ignored
    install_stop_handlers()
    sys.exit(main())
