"""PNG plots of a run's metrics: reward, validation accuracy, KL, entropy, response length, loss,
time per stage and the train-inference mismatch, one file each under <output_dir>/plots/.

Each plot draws every metric whose name matches its pattern, so metric names chosen later
(e.g. `val/arith/accuracy` beside `val/accuracy`) appear without changes here. Files are written
to a temporary name and renamed, so an image viewer never reads a half-written PNG.

`plot_metrics` takes the records; `tracking.plot_metrics_file` reads them from a run's metrics.jsonl:

    python -c "from hybridflow.utils.tracking import plot_metrics_file; plot_metrics_file('outputs/run')"
"""

import os
import re
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class PlotSpec:
    """One PNG: the metrics whose names match `pattern` (re.search), against the step."""

    name: str
    title: str
    pattern: str


PLOTS = (
    # with reward/<data_source>/mean, each source's mean when a batch mixes several
    PlotSpec("reward", "Reward (mean score per response)", r"^(reward(/.+)?|critic/(score|rewards))/mean$"),
    PlotSpec("val_accuracy", "Validation accuracy", r"^val/(.+/)?accuracy$"),
    PlotSpec("kl", "KL divergence", r"(^|/)(ppo_kl|kl_loss|kl)(/|$)|^kl/"),
    PlotSpec("entropy", "Policy entropy", r"entropy"),
    PlotSpec("response_length", "Response length (tokens)", r"^response_length/(mean|max)$"),
    PlotSpec("loss", "Loss", r"(^|/)(loss|pg_loss|vf_loss)$"),
    PlotSpec("timing", "Time per stage (s)", r"^timing(_s)?/"),
    PlotSpec("mismatch", "Train-inference mismatch (engine vs actor log-probs)", r"^mismatch/"),
)


def matching_keys(history: list[dict], pattern: str) -> list[str]:
    """Metric names in `history` matching `pattern`, in first-seen order."""
    regex = re.compile(pattern)
    keys: dict[str, None] = {}
    for record in history:
        for key in record:
            if key != "step" and regex.search(key):
                keys[key] = None
    return list(keys)


def series(history: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of the records that have `key`."""
    points = [(r["step"], r[key]) for r in history if key in r]
    return [p[0] for p in points], [p[1] for p in points]


def render(spec: PlotSpec, history: list[dict], keys: list[str], path: Path) -> None:
    """Draw one plot with matplotlib's Agg canvas (no display, no global pyplot state)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 4.0), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for key in keys:
        steps, values = series(history, key)
        ax.plot(steps, values, marker="o" if len(steps) < 30 else None, markersize=3, label=key)
    ax.set_title(spec.title)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp")
    fig.savefig(tmp, format="png")
    os.replace(tmp, path)


def plot_metrics(history: list[dict], plots_dir: str | Path) -> list[Path]:
    """Writes one PNG per plot that has at least one matching metric; returns the paths."""
    plots_dir = Path(plots_dir)
    plots_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for spec in PLOTS:
        keys = matching_keys(history, spec.pattern)
        if keys:
            path = plots_dir / f"{spec.name}.png"
            render(spec, history, keys, path)
            written.append(path)
    return written
