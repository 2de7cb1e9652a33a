"""What a comparison between engines needs before its ratio means anything: both sides
measured the same way, in alternating repetitions, on a machine whose load held still.

    rounds = alternating({"hf": run_hf, "vllm": run_vllm}, repeats=3, loads=loads)  # hf vllm hf vllm ...
    median, spread = summary(rounds["vllm"])
    ratio_text(median_hf, median_vllm, loads)   # "2.95x hf", or why no ratio is given

Alternating (A B A B A B rather than A A A B B B) puts a change of the machine's state (another job,
thermal limits, a cache) on both sides alike; the load samples taken before each round say whether
such a change happened at all. The one-minute load average counts the benchmark's own processes
too, so what is compared is the samples taken at the rounds' starts after the first (the first is
the machine before any work) and at the end: a foreign job that started or stopped moves them.
"""

import os
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

# Load-average points the round samples may move before a ratio is refused: half a core of a
# 2-core machine (BENCH_LOAD_LIMIT overrides).
LOAD_LIMIT = float(os.environ.get("BENCH_LOAD_LIMIT", "1.0"))


@dataclass
class LoadSamples:
    """The machine's one-minute load average before the work and at each round's start and the end."""

    before: float = field(default_factory=lambda: os.getloadavg()[0])
    rounds: list[float] = field(default_factory=list)

    def sample(self) -> None:
        self.rounds.append(os.getloadavg()[0])

    def moved(self) -> float:
        """How far the samples after the first round's start moved (max - min)."""
        later = self.rounds[1:]
        return max(later) - min(later) if len(later) > 1 else 0.0

    def text(self) -> str:
        rounds = " ".join(f"{load:.2f}" for load in self.rounds)
        return f"load {self.before:.2f} before; at each round and the end: {rounds}"


def alternating(
    cases: dict[str, Callable[[], float]], repeats: int, loads: LoadSamples
) -> dict[str, list[float]]:
    """Each case's seconds over `repeats` rounds of every case in turn; a case returns the seconds
    of its own timed part (its warm-up excluded)."""
    seconds: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(repeats):
        loads.sample()
        for name, run in cases.items():
            seconds[name].append(run())
    loads.sample()
    return seconds


def summary(seconds: list[float]) -> tuple[float, float]:
    """The median and the spread, (max - min) / median."""
    median = statistics.median(seconds)
    return median, (max(seconds) - min(seconds)) / median


def ratio_text(base_seconds: float, seconds: float, loads: LoadSamples, base: str = "hf") -> str:
    """`base_seconds / seconds` as "<r>x <base>", or the reason no ratio is printed."""
    if loads.moved() > LOAD_LIMIT:
        return f"no ratio: the load moved by {loads.moved():.2f} during the run (limit {LOAD_LIMIT:g})"
    return f"{base_seconds / seconds:.2f}x {base}"
