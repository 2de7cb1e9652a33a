"""`make bench` writes each benchmark's table into its docs/results/ page, with the command, date,
machine and commit that produced it (benchmarks/_results.py); no benchmark runs here."""

import re
import subprocess
from pathlib import Path

import pytest

from benchmarks import _results
from benchmarks._results import Provenance, cpu_model, git_commit, refresh_page, render_block

ROOT = Path(__file__).resolve().parents[1]
ROWS = [{"mode": "sync", "step_s": 2.5812, "note": "a|b"}, {"mode": "one_step", "step_s": 1.7401, "note": ""}]
MADE_BY = Provenance("python -m benchmarks async", "2026-12-06 07:00 UTC", "Some CPU, 2 cores", "abc1234")


def test_the_block_holds_the_table_and_where_it_came_from():
    block = render_block("async", "Async step time", ROWS, MADE_BY)
    lines = block.splitlines()
    assert lines[0] == "<!-- bench:async -->" and lines[-1] == "<!-- /bench:async -->"
    assert "### Async step time" in lines
    for line in ("- Command: `python -m benchmarks async`", "- Date: 2026-12-06 07:00 UTC",
                 "- Machine: Some CPU, 2 cores", "- Commit: abc1234"):  # fmt: skip
        assert line in lines
    assert "| mode | step_s | note |" in lines
    assert "| sync | 2.581 | a\\|b |" in lines  # floats to 4 significant digits, pipes escaped
    assert "| one_step | 1.74 |  |" in lines


def test_refreshing_replaces_only_its_own_block(tmp_path):
    page = tmp_path / "async.md"
    page.write_text("# Async\n\nintro\n\n<!-- bench:async -->\nold table\n<!-- /bench:async -->\n\noutro\n")
    refresh_page(page, "async", render_block("async", "Async step time", ROWS, MADE_BY))
    refresh_page(page, "other", render_block("other", "Other", ROWS[:1], MADE_BY))
    text = page.read_text()
    assert "old table" not in text
    assert text.startswith("# Async\n\nintro\n\n<!-- bench:async -->\n### Async step time")
    assert text.count("<!-- bench:async -->") == 1 and "\n\noutro\n" in text
    assert text.rstrip().endswith("<!-- /bench:other -->")  # a page without the block gets it appended


def test_write_results_creates_the_mapped_page_with_this_machine_and_commit(tmp_path):
    page = _results.write_results("async", "Async step time", ROWS, results_dir=tmp_path)
    assert page == tmp_path / "async.md"
    text = page.read_text()
    assert "- Command: `python -m benchmarks async`" in text
    assert re.search(r"^- Date: \d{4}-\d\d-\d\d \d\d:\d\d UTC$", text, re.M)
    assert f"- Machine: {cpu_model()}" in text
    assert f"- Commit: {git_commit()}" in text


def test_cpu_model_reads_the_model_name(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: AMD EPYC 9B14\nflags\t: avx\n\nprocessor\t: 1\n")
    assert cpu_model(cpuinfo).startswith("AMD EPYC 9B14, ")
    assert cpu_model(tmp_path / "absent").startswith("unknown CPU, ")


def test_git_commit_is_the_checkouts_head():
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    if head.returncode != 0:
        pytest.skip(f"{ROOT} is not a git checkout (an exported tree): {head.stderr.strip()}")
    assert git_commit(ROOT).split()[0] == head.stdout.strip()


def test_every_benchmark_has_a_results_page():
    names = {p.stem.removeprefix("bench_") for p in (ROOT / "benchmarks").glob("bench_*.py")}
    assert names == set(_results.PAGES)
    assert all((ROOT / "docs" / "results" / page).is_file() for page in _results.PAGES.values())


def test_a_learning_row_reads_accuracy_at_the_first_and_last_validation():
    from benchmarks.learning import gain_row, median_step_s

    records = [
        {"step": 0, "val/accuracy": 0.365},
        {"step": 1, "timing/step": 4.0},
        {"step": 2, "timing/step": 9.0},
        {"step": 20, "timing/step": 5.0, "val/accuracy": 0.6},
    ]
    assert gain_row(records) == {"step 0": "36.5%", "step 20": "60.0%", "gain": "+23.5"}
    assert median_step_s(records) == 5.0


def test_a_stopped_learning_run_is_a_row_with_its_error_line(tmp_path):
    from benchmarks.learning import LOSS_STEPS, RunStopped, stopped_row

    log = tmp_path / "run.log"
    log.write_text(
        "step 1 | reward 0.2\nerror: the update would change the weights by 31% (max_update_ratio 0.25)\n"
    )
    records = [
        {"step": 0, "val/accuracy": 0.4},
        {"step": 1, "reward/mean": 0.2},
        {"step": 2, "reward/mean": 0.3},
    ]
    row = stopped_row(RunStopped("recipes/quickstart.yaml", log, records))
    assert row == {
        "step 0": "40.0%",
        f"step {LOSS_STEPS}": "stopped after step 2: error: the update would change the weights by 31% "
        "(max_update_ratio 0.25)",
        "gain": "-",
    }


def test_a_change_to_the_results_pages_alone_leaves_the_commit_unmarked(tmp_path):
    def git(*args: str) -> None:
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path, check=True,
                       capture_output=True)  # fmt: skip

    (tmp_path / "docs" / "results").mkdir(parents=True)
    (tmp_path / "docs" / "results" / "learning.md").write_text("# Learning\n")
    (tmp_path / "code.py").write_text("A = 1\n")
    git("init", "-q")
    git("add", ".")
    git("commit", "-q", "-m", "first")
    (tmp_path / "docs" / "results" / "learning.md").write_text("# Learning\n\na table written\n")
    assert "uncommitted" not in git_commit(tmp_path)
    (tmp_path / "code.py").write_text("A = 2\n")
    assert git_commit(tmp_path).endswith(" with uncommitted changes")
