"""`make bench`: runs every `benchmarks/bench_*.py` module's `run()`, prints its table and writes
it into its docs/results/ page with the command, date, machine and commit (`_results.py`).

Each module exposes `TITLE` and `run() -> list[dict]` (one dict per table row, same keys).
Run one with `python -m benchmarks protocol` (the part after `bench_`).
"""

import importlib
import pkgutil
import sys
from pathlib import Path

from benchmarks._results import write_results


def _format_table(rows: list[dict]) -> str:
    headers = list(rows[0])
    cells = [[_format_cell(row[h]) for h in headers] for row in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in cells]
    return "\n".join(lines)


def _format_cell(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def main(selected: list[str]) -> None:
    names = sorted(m.name for m in pkgutil.iter_modules([str(Path(__file__).parent)]))
    for name in names:
        if not name.startswith("bench_") or (selected and name.removeprefix("bench_") not in selected):
            continue
        module = importlib.import_module(f"benchmarks.{name}")
        print(f"\n== {module.TITLE} ==", flush=True)
        rows = module.run()
        print(_format_table(rows), flush=True)
        print(f"(written to {write_results(name.removeprefix('bench_'), module.TITLE, rows)})", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
