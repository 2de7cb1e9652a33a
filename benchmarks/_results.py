"""`make bench` keeps docs/results/ current: each benchmark's table is written into its results
page between `<!-- bench:NAME -->` and `<!-- /bench:NAME -->`, headed by the command, the date
(UTC), the machine and the commit that produced it, so a figure never stands without them.

    write_results("protocol", module.TITLE, rows)   # after `python -m benchmarks protocol` ran
"""

import os
import re
import subprocess
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = ROOT / "docs" / "results"
# benchmark name (the part after `bench_`) -> its results page in RESULTS_DIR
PAGES = {
    "async": "async.md",
    "attention": "packing.md",
    "delta_sync": "delta-sync.md",
    "dispatch": "dataproto.md",
    "lora_sync": "lora.md",
    "megatron": "packing.md",
    "protocol": "dataproto.md",
    "rollout": "engines.md",
    "vllm": "engines.md",
}


@dataclass(frozen=True)
class Provenance:
    """What produced a table."""

    command: str
    date: str  # "YYYY-MM-DD HH:MM UTC"
    machine: str
    commit: str


def cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The CPU's model name and this process's usable core count, e.g. "AMD EPYC 9B14, 2 cores"."""
    names = re.findall(r"^model name\s*:\s*(.+)$", cpuinfo.read_text(), re.M) if cpuinfo.exists() else []
    return f"{names[0].strip() if names else 'unknown CPU'}, {len(os.sched_getaffinity(0))} cores"


def git_commit(root: Path = ROOT) -> str:
    """`git rev-parse --short HEAD`, marked when the working tree has uncommitted changes outside
    docs/results/."""

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True).stdout.strip()

    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    # the results pages themselves do not change what is measured (a table written before another)
    changed = git("status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)docs/results")
    return f"{commit} with uncommitted changes" if changed else commit


def provenance(command: str) -> Provenance:
    return Provenance(
        command=command,
        date=datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        machine=cpu_model(),
        commit=git_commit(),
    )


def _cell(value) -> str:
    text = f"{value:.4g}" if isinstance(value, float) else str(value)
    return text.replace("|", "\\|")  # a pipe would end the Markdown cell


def markdown_table(rows: list[dict]) -> str:
    headers = list(rows[0])
    lines = ["| " + " | ".join(headers) + " |", "|" + " --- |" * len(headers)]
    lines += ["| " + " | ".join(_cell(row[h]) for h in headers) + " |" for row in rows]
    return "\n".join(lines)


def render_block(name: str, title: str, rows: list[dict], made_by: Provenance) -> str:
    """The marked block of one benchmark: its title, where the table came from, the table."""
    return "\n".join([
        f"<!-- bench:{name} -->",
        f"### {title}",
        "",
        f"- Command: `{made_by.command}`",
        f"- Date: {made_by.date}",
        f"- Machine: {made_by.machine}",
        f"- Commit: {made_by.commit}",
        "",
        markdown_table(rows),
        f"<!-- /bench:{name} -->",
    ])  # fmt: skip


def refresh_page(page: Path, name: str, block: str) -> None:
    """Replace the page's block of `name`, or append the block (creating the page) if it has none."""
    text = page.read_text() if page.exists() else f"# Benchmark results: {name}\n"
    marked = re.compile(rf"<!-- bench:{re.escape(name)} -->.*?<!-- /bench:{re.escape(name)} -->", re.S)
    if marked.search(text):
        text = marked.sub(lambda _: block, text, count=1)
    else:
        text = f"{text.rstrip()}\n\n{block}\n"
    page.write_text(text)


def write_results(name: str, title: str, rows: list[dict], results_dir: Path = RESULTS_DIR) -> Path:
    """Write benchmark `name`'s table into its results page; returns the page."""
    page = results_dir / PAGES.get(name, f"{name}.md")
    refresh_page(page, name, render_block(name, title, rows, provenance(f"python -m benchmarks {name}")))
    return page
