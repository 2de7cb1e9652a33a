"""Learning tables, too long for `make bench` (tens of minutes on 2 cores): each trains the tiny
model from an SFT warm start on several seeds and writes held-out accuracy before and after into
docs/results/learning.md, with the command, date, machine and commit.

    python -m benchmarks.learning losses          # GRPO's PPO-clip vs CISPO, SAPO, GMPO, DPPO-TV
    python -m benchmarks.learning reasoning_gym   # the reasoning-gym quickstart pair

Runs go through `scripts/run_recipe.sh` (a local Ray cluster each) under --out (default
outputs/learning_tables/); each run's log is <out>/<run>/run.log.
"""

import argparse
import os
import statistics
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from benchmarks._results import RESULTS_DIR, ROOT, provenance, refresh_page, render_block
from hybridflow.data.arith import write_arith_parquet
from hybridflow.utils.tiny_model import make_tiny_model
from hybridflow.utils.tracking import read_metrics

SEEDS = [(1, 42), (2, 2), (3, 3)]  # data.seed / rollout.seed; 1 / 42 are the recipes' own
LOSSES = ["vanilla", "cispo", "sapo", "gmpo", "dppo_tv"]  # actor.update.policy_loss
LOSS_STEPS = 20  # the learning tests' length (tests/learning_runs.py)
# Two optimizer steps per RL step (256 sequences), the second off-policy by one update: in one
# on-policy step (r = 1) vanilla, cispo, sapo and dppo_tv have the same gradient, -A grad log pi.
LOSS_SETTINGS = ["actor.update.ppo_mini_batch_size=128"]
PAGE = "learning.md"  # in docs/results/
RG_TASKS = ["chain_sum", "basic_arithmetic"]  # recipes/reasoning_gym_quickstart.yaml's


class RunStopped(RuntimeError):
    """A run that ended with an error: its error line and the metrics it logged before."""

    def __init__(self, recipe: str, log: Path, records: list[dict]):
        errors = [line for line in log.read_text().splitlines() if line.startswith("error:")]
        self.line = errors[-1] if errors else f"no error line: see {log}"
        self.records = records
        super().__init__(f"{recipe} stopped ({self.line}): see {log}")


def run_recipe(recipe: str, out: Path, overrides: list[str]) -> list[dict]:
    """`bash scripts/run_recipe.sh <recipe> <overrides>` into `out` on a local Ray cluster of its
    own; its metrics records. A failed run raises RunStopped."""
    out.mkdir(parents=True, exist_ok=True)
    log = out / "run.log"
    env = {**os.environ, "RAY_ADDRESS": "local", "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    command = [
        "bash",
        "scripts/run_recipe.sh",
        recipe,
        f"trainer.output_dir={out}",
        "trainer.logger=[console]",
    ]
    with log.open("w") as stream:
        done = subprocess.run(
            [*command, *overrides], cwd=ROOT, env=env, stdout=stream, stderr=subprocess.STDOUT
        )
    records = read_metrics(out / "metrics.jsonl")  # [] when the run stopped before its first record
    if done.returncode != 0:
        raise RunStopped(recipe, log, records)
    return records


def warm_start(root: Path, sft_recipe: str, data_overrides: list[str]) -> Path:
    """The tiny model trained by `sft_recipe` into <root>/sft (once: reused when its export exists);
    the export's path."""
    export = root / "sft" / "hf"
    if not (export / "config.json").exists():
        model = make_tiny_model(root / "tiny_model")
        run_recipe(sft_recipe, root / "sft", [f"model.path={model}", *data_overrides, "trainer.test_freq=0"])
    return export


def accuracy_by_step(records: list[dict], key: str = "val/accuracy") -> dict[int, float]:
    return {r["step"]: r[key] for r in records if key in r}


def median_step_s(records: list[dict]) -> float:
    times = [r["timing/step"] for r in records if "timing/step" in r]
    return statistics.median(times) if times else float("nan")


def gain_row(records: list[dict], key: str = "val/accuracy") -> dict:
    """Held-out accuracy at the first and last validation and the gain, in points."""
    accuracy = accuracy_by_step(records, key)
    first, last = min(accuracy), max(accuracy)
    return {
        f"step {first}": f"{accuracy[first]:.1%}",
        f"step {last}": f"{accuracy[last]:.1%}",
        "gain": f"{100 * (accuracy[last] - accuracy[first]):+.1f}",
    }


def stopped_row(stopped: RunStopped) -> dict:
    """A stopped run's cells beside `gain_row`'s: the step it reached and its error line."""
    accuracy = accuracy_by_step(stopped.records)
    steps = [r["step"] for r in stopped.records]
    return {
        "step 0": f"{accuracy[0]:.1%}" if 0 in accuracy else "-",
        f"step {LOSS_STEPS}": f"stopped after step {max(steps, default=0)}: {stopped.line}",
        "gain": "-",
    }


def losses_table(out: Path) -> list[dict]:
    """recipes/quickstart.yaml for LOSS_STEPS steps from the quickstart's warm start, once per loss
    and seed pair, everything else the recipe's."""
    data = write_arith_parquet(out / "data")
    data_overrides = [f"data.train_files=[{data['train']}]", f"data.val_files=[{data['test']}]"]
    hf = warm_start(out, "recipes/quickstart_sft.yaml", data_overrides)
    rows = []
    for loss in LOSSES:
        for data_seed, rollout_seed in SEEDS:
            run = out / f"{loss}-{data_seed}-{rollout_seed}"
            overrides = [
                f"model.path={hf}", *data_overrides, *LOSS_SETTINGS, f"actor.update.policy_loss={loss}",
                f"data.seed={data_seed}", f"rollout.seed={rollout_seed}",
                f"trainer.total_training_steps={LOSS_STEPS}", f"trainer.test_freq={LOSS_STEPS}",
                "trainer.save_freq=0", "trainer.export_hf=false",
            ]  # fmt: skip
            try:
                records = run_recipe("recipes/quickstart.yaml", run, overrides)
                outcome = gain_row(records)
            except RunStopped as stopped:  # e.g. the update-size guard: a result of the loss, in the table
                records, outcome = stopped.records, stopped_row(stopped)
            rows.append({"policy_loss": loss, "seeds": f"{data_seed} / {rollout_seed}", **outcome,
                         "median step s": median_step_s(records)})  # fmt: skip
            print(rows[-1], flush=True)
    return rows


def reasoning_gym_table(out: Path) -> list[dict]:
    """The reasoning-gym quickstart pair as its recipes stand (SFT warm start, then GRPO), once per
    seed pair; overall and per-task held-out accuracy at the first and last validation."""
    hf = warm_start(out, "recipes/reasoning_gym_quickstart_sft.yaml", [])
    rows = []
    for data_seed, rollout_seed in SEEDS:
        run = out / f"grpo-{data_seed}-{rollout_seed}"
        records = run_recipe("recipes/reasoning_gym_quickstart.yaml", run, [
            f"model.path={hf}", f"data.seed={data_seed}", f"rollout.seed={rollout_seed}",
            "trainer.save_freq=0", "trainer.export_hf=false",
        ])  # fmt: skip
        row = {"seeds": f"{data_seed} / {rollout_seed}", **gain_row(records)}
        for task in RG_TASKS:
            accuracy = accuracy_by_step(records, f"val/reasoning_gym/{task}/accuracy")
            row[task] = f"{accuracy[min(accuracy)]:.1%} -> {accuracy[max(accuracy)]:.1%}"
        rows.append({**row, "median step s": median_step_s(records)})
        print(rows[-1], flush=True)
    return rows


TABLES: dict[str, tuple[str, Callable[[Path], list[dict]]]] = {
    "losses": (
        f"Policy losses on the quickstart: {LOSS_STEPS} GRPO steps from the warm start, held-out accuracy",
        losses_table,
    ),
    "reasoning_gym": (
        "reasoning-gym quickstart (chain_sum + basic_arithmetic): GRPO from the SFT warm start, "
        "held-out accuracy",
        reasoning_gym_table,
    ),
}


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.learning", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("table", choices=sorted(TABLES), help="which learning table to measure")
    parser.add_argument(
        "--out", type=Path, default=ROOT / "outputs" / "learning_tables", help="work directory"
    )
    args = parser.parse_args(argv)
    title, measure = TABLES[args.table]
    made_by = provenance(f"python -m benchmarks.learning {args.table}")  # the commit and date it started at
    rows = measure(args.out.resolve() / args.table)
    refresh_page(
        RESULTS_DIR / PAGE,
        f"learning_{args.table}",
        render_block(f"learning_{args.table}", title, rows, made_by),
    )
    print(f"(written to {RESULTS_DIR / PAGE})")


if __name__ == "__main__":
    main(sys.argv[1:])
