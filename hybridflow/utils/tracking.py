"""Where each step's metrics go: metrics.jsonl (always), the console, a progress bar, TensorBoard,
Weights & Biases, and PNG plots refreshed every few steps (and never for more than a tenth of the
run's time).

    tracker = Tracking(output_dir, backends=["console", "progress", "plots"], total_steps=100)
    tracker.log({"reward/mean": 0.4, "val/accuracy": 0.5}, step=1)
    tracker.close()

A resumed run passes `resume_step`: the records up to that step stay in metrics.jsonl byte for
byte and the new ones are appended; the records after it (written by the interrupted run after its
last checkpoint, possibly ending in a half-written line) are cut off the end of the file and
purged from TensorBoard, so the file holds exactly one record per step. A fresh start in a
directory that already holds metrics.jsonl moves that file aside to metrics.jsonl.<k> (never
deleted).
"""

import json
import math
import numbers
import os
import time
from pathlib import Path

from hybridflow.utils import plotting

BACKENDS = ("console", "progress", "tensorboard", "wandb", "plots")
METRICS_FILE = "metrics.jsonl"
# the share of a run's wall time the periodic plot refreshes may take at most
PLOT_TIME_SHARE = 0.1

# Shown on the console line and progress bar when present, under these short names.
HIGHLIGHTS = {
    "reward/mean": "reward",
    "val/accuracy": "val_acc",
    "sft/loss": "loss",
    "response_length/mean": "resp_len",
    "timing/step": "step_s",
}


def plots_due(steps_since: int, plot_every: int, last_render_s: float, since_render_s: float) -> bool:
    """Whether the periodic plots are due: `plot_every` steps logged since the last render (0:
    never), and as long since it as PLOT_TIME_SHARE allows for its rendering time. With steps of a
    fraction of a second (a tiny model on CPU) a render every 5 steps would cost as much as the
    steps themselves; with steps of minutes `plot_every` decides alone."""
    return (
        bool(plot_every)
        and steps_since >= plot_every
        and last_render_s <= PLOT_TIME_SHARE * (last_render_s + since_render_s)
    )


def to_float(value) -> float:
    """A metric as a plain float (accepts Python and numpy numbers and 0-d tensors)."""
    if hasattr(value, "item"):
        value = value.item()
    if not isinstance(value, numbers.Real):
        raise TypeError(f"metric values must be numbers, got {type(value).__name__}: {value!r}")
    return float(value)


def read_metrics(path: str | Path) -> list[dict]:
    """Records of a metrics.jsonl file, in file order ([] when it does not exist)."""
    path = Path(path)
    if not path.exists():
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def plot_metrics_file(output_dir: str | Path) -> list[Path]:
    """Plots <output_dir>/metrics.jsonl into <output_dir>/plots/ (for a finished or running run)."""
    output_dir = Path(output_dir)
    history = read_metrics(output_dir / METRICS_FILE)
    if not history:
        raise ValueError(f"{output_dir / METRICS_FILE} has no metrics to plot")
    return plotting.plot_metrics(history, output_dir / "plots")


def records_up_to(path: Path, step: int) -> tuple[list[dict], int]:
    """The leading records of metrics.jsonl `path` with a step <= `step`, and the byte offset where
    they end: the first record past `step`, or a line that is not complete JSON (a run killed
    while writing), ends them."""
    kept, end = [], 0
    if not path.exists():
        return kept, end
    with open(path, "rb") as f:
        for line in f:
            try:
                record = json.loads(line) if line.endswith(b"\n") else None
            except json.JSONDecodeError:
                record = None
            if record is None or record["step"] > step:
                break
            kept.append(record)
            end += len(line)
    return kept, end


def next_free_name(path: Path) -> Path:
    """`path` with the first suffix .1, .2, ... that names no existing file."""
    k = 1
    while path.with_name(f"{path.name}.{k}").exists():
        k += 1
    return path.with_name(f"{path.name}.{k}")


def move_aside(path: Path) -> None:
    """An earlier run's `path` (a file or a folder) renamed to `path`.<k>, never deleted: a fresh
    start in a run's directory."""
    if path.exists():
        aside = next_free_name(path)
        os.replace(path, aside)
        print(f"fresh start: moved the earlier {path.name} to {aside.name}", flush=True)


def format_highlights(record: dict) -> str:
    """`reward 0.412 | val_acc 0.530 | ...` for the highlighted metrics present in `record`."""
    parts = [f"{short} {record[key]:.4g}" for key, short in HIGHLIGHTS.items() if key in record]
    return " | ".join(parts)


class Tracking:
    """Sends `log(metrics, step)` to every enabled backend; metrics.jsonl is always written.

    backends: any of "console" (one line per step), "progress" (a tqdm bar showing step, reward,
    accuracy), "tensorboard" (<output_dir>/tensorboard), "wandb" (<output_dir>/wandb; WANDB_MODE,
    WANDB_API_KEY etc. as wandb reads them), "plots" (<output_dir>/plots/*.png, rendered at close
    and every `plot_every` logged steps, or less often where rendering would take more than
    PLOT_TIME_SHARE of the time: `plots_due`; 0: only at close).
    """

    def __init__(
        self,
        output_dir: str | Path,
        backends: list[str] | tuple[str, ...] = ("console",),
        project_name: str = "hybridflow",
        experiment_name: str = "run",
        config: dict | None = None,
        total_steps: int | None = None,
        plot_every: int = 5,
        resume_step: int | None = None,
    ):
        unknown = [b for b in backends if b not in BACKENDS]
        if unknown:
            raise ValueError(f"trainer.logger has unknown backends {unknown}; choose from {list(BACKENDS)}")
        if plot_every < 0:
            raise ValueError(f"plot_every must be >= 0, got {plot_every}")
        self.output_dir = Path(output_dir)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.output_dir / METRICS_FILE
        self.plots_dir = self.output_dir / "plots"
        # rendering costs about a second a time on a CPU core (matplotlib): only where asked for
        self.plots = "plots" in backends
        self.plot_every = plot_every
        self.backends = list(backends)
        self.history = self._resume_history(resume_step)
        self._steps_since_plot = 0
        self._last_render = (0.0, 0.0)  # (seconds it took, time.monotonic() when it ended)
        self._latest = {}  # last value of each highlighted metric, for the progress bar
        self._jsonl = open(self.metrics_path, "a")  # noqa: SIM115 (kept open for the run)
        self._tensorboard = self._open_tensorboard(resume_step) if "tensorboard" in backends else None
        self._wandb = self._open_wandb(project_name, experiment_name, config) if "wandb" in backends else None
        self._progress = self._open_progress(total_steps, resume_step) if "progress" in backends else None

    def _resume_history(self, resume_step: int | None) -> list[dict]:
        """Records kept from an earlier run in this directory; without `resume_step` a run starts
        a fresh file (an existing one is moved aside)."""
        if resume_step is None:
            move_aside(self.metrics_path)
            return []
        kept, end = records_up_to(self.metrics_path, resume_step)
        if self.metrics_path.exists() and self.metrics_path.stat().st_size > end:
            os.truncate(self.metrics_path, end)  # only the interrupted run's rows after resume_step
        return kept

    def _open_tensorboard(self, resume_step: int | None):
        from torch.utils.tensorboard import SummaryWriter

        # purge_step hides events an interrupted run wrote after the checkpoint it resumes from
        purge = resume_step + 1 if resume_step is not None else None
        return SummaryWriter(log_dir=str(self.output_dir / "tensorboard"), purge_step=purge)

    def _open_wandb(self, project_name: str, experiment_name: str, config: dict | None):
        try:
            import wandb
        except ImportError as err:
            raise ValueError(
                "trainer.logger includes 'wandb' but wandb is not installed: `pip install wandb`, "
                "or remove 'wandb' from trainer.logger"
            ) from err
        # the run's files go under the output directory (WANDB_MODE=offline keeps them there to `wandb sync`)
        return wandb.init(
            project=project_name, name=experiment_name, config=config or {}, dir=str(self.output_dir)
        )

    def _open_progress(self, total_steps: int | None, resume_step: int | None):
        from tqdm import tqdm

        return tqdm(
            total=total_steps, initial=resume_step or 0, desc="train", unit="step", dynamic_ncols=True
        )

    def log(self, metrics: dict, step: int) -> None:
        """Record `metrics` (name -> number) for global step `step`."""
        record = {"step": int(step), **{k: to_float(v) for k, v in metrics.items()}}
        self.history.append(record)
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        if self._tensorboard is not None:
            for key, value in record.items():
                if key != "step" and math.isfinite(value):
                    self._tensorboard.add_scalar(key, value, global_step=step)
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in record.items() if k != "step"}, step=step)
        self._show(record)
        self._steps_since_plot += 1
        render_s, ended = self._last_render
        if self.plots and plots_due(
            self._steps_since_plot, self.plot_every, render_s, time.monotonic() - ended
        ):
            self.refresh_plots()

    def _show(self, record: dict) -> None:
        line = format_highlights(record)
        if self._progress is not None:
            # the bar keeps the last value of each highlight (accuracy is only measured every few steps)
            self._latest.update({k: v for k, v in record.items() if k in HIGHLIGHTS})
            self._progress.set_postfix_str(format_highlights(self._latest), refresh=False)
            self._progress.update(max(0, record["step"] - self._progress.n))
        if "console" in self.backends:
            text = f"step {record['step']}" + (f" | {line}" if line else "")
            if self._progress is not None:
                self._progress.write(text)
            else:
                print(text, flush=True)

    def refresh_plots(self) -> list[Path]:
        """Re-render the PNG plots from every record so far; returns the files written."""
        self._steps_since_plot = 0
        start = time.monotonic()
        files = plotting.plot_metrics(self.history, self.plots_dir)
        end = time.monotonic()
        self._last_render = (end - start, end)
        return files

    def close(self) -> None:
        """Final plots (with the "plots" backend), then flush and close every backend."""
        if self.history and self.plots:
            self.refresh_plots()
        self._jsonl.close()
        if self._tensorboard is not None:
            self._tensorboard.close()
        if self._wandb is not None:
            self._wandb.finish()
        if self._progress is not None:
            self._progress.close()
