"""Tracking: metrics.jsonl records, console/progress lines, TensorBoard scalars, plots refreshed
every few steps, and trimming of records past the resume step."""

import json
import sys
import time
from pathlib import Path

import pytest

from hybridflow.utils.plotting import PLOTS, matching_keys
from hybridflow.utils.tracking import Tracking, plot_metrics_file, plots_due, read_metrics

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def step_metrics(step: int) -> dict:
    return {
        "reward/mean": 0.1 * step,
        "val/accuracy": 0.05 * step,
        "actor/ppo_kl": 0.001 * step,
        "actor/entropy": 2.0 - 0.1 * step,
        "response_length/mean": 10.0 + step,
        "timing/gen": 1.5,
        "timing/update_actor": 0.5,
    }


def test_jsonl_has_one_record_per_step_and_numbers_become_floats(tmp_path):
    import numpy as np
    import torch

    tracker = Tracking(tmp_path, backends=[], plot_every=0)
    tracker.log({"a": torch.tensor(1.5), "b": np.float32(2.0), "c": 3}, step=1)
    tracker.log({"a": 0.5}, step=2)
    tracker.close()
    assert read_metrics(tmp_path / "metrics.jsonl") == [
        {"step": 1, "a": 1.5, "b": 2.0, "c": 3.0},
        {"step": 2, "a": 0.5},
    ]


def test_non_numbers_and_unknown_backends_are_rejected(tmp_path):
    with pytest.raises(ValueError, match=r"unknown backends \['mlflow'\]"):
        Tracking(tmp_path, backends=["console", "mlflow"])
    tracker = Tracking(tmp_path, backends=[], plot_every=0)
    with pytest.raises(TypeError, match="metric values must be numbers, got str"):
        tracker.log({"a": "high"}, step=1)
    tracker.close()


def test_wandb_without_the_package_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # what a missing package looks like to `import`
    with pytest.raises(ValueError, match="wandb is not installed"):
        Tracking(tmp_path, backends=["wandb"])


def wandb_records(path: Path) -> list[bytes]:
    """The protobuf records of a .wandb file: a 7-byte ":W&B" header, then LevelDB's log format
    (32 KiB blocks of chunks with a 7-byte header: CRC-32C, little-endian length, type 1 full /
    2 first / 3 middle / 4 last); read independently of wandb, which offers no reader."""
    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B"
    pos, records, pending = 7, [], b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            records.append(pending)
            pending = b""
    return records


def read_wandb_run(path: Path, timeout_s: float = 120.0) -> list:
    """The run's decoded records once its exit record is there (wandb's writer process may still be
    flushing the file when `finish()` returns)."""
    from wandb.proto.wandb_internal_pb2 import Record

    deadline = time.monotonic() + timeout_s
    while True:
        records = []
        for raw in wandb_records(path):
            records.append(Record())
            records[-1].ParseFromString(raw)
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
            return records
        time.sleep(0.5)


def test_wandb_offline_run_holds_every_logged_step_and_the_config(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    tracker = Tracking(
        tmp_path, backends=["wandb"], project_name="p", experiment_name="e", config={"actor": {"lr": 0.5}}
    )
    for step in (1, 2):
        tracker.log(step_metrics(step), step=step)
    tracker.close()
    (run_file,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    records = read_wandb_run(run_file)
    history = [
        {"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in r.history.item}
        for r in records
        if r.WhichOneof("record_type") == "history"
    ]
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    config = {i.key: json.loads(i.value_json) for i in run.config.update}
    assert [row["_step"] for row in history] == [1, 2]
    for row, step in zip(history, (1, 2), strict=True):
        assert {k: row[k] for k in step_metrics(step)} == pytest.approx(step_metrics(step))
    assert config["actor"] == {"lr": 0.5}


def test_console_line_shows_highlights(tmp_path, capsys):
    tracker = Tracking(tmp_path, backends=["console"], plot_every=0)
    tracker.log({"reward/mean": 0.25, "val/accuracy": 0.5, "other": 1.0}, step=7)
    tracker.close()
    assert capsys.readouterr().out.strip() == "step 7 | reward 0.25 | val_acc 0.5"


def test_progress_bar_tracks_step_and_postfix(tmp_path, capsys):
    tracker = Tracking(tmp_path, backends=["progress"], total_steps=4, plot_every=0)
    tracker.log({"reward/mean": 0.75, "val/accuracy": 0.25}, step=1)
    tracker.log({"reward/mean": 0.5}, step=2)
    assert tracker._progress.n == 2
    tracker.close()
    assert "reward 0.5 | val_acc 0.25" in capsys.readouterr().err  # accuracy stays on the bar


def test_plots_are_refreshed_every_few_steps_and_hold_matching_metrics(tmp_path):
    tracker = Tracking(tmp_path, backends=["plots"], plot_every=3)
    tracker.log(step_metrics(1), step=1)
    tracker.log(step_metrics(2), step=2)
    assert not (tmp_path / "plots").exists()
    tracker.log(step_metrics(3), step=3)
    names = {"reward", "val_accuracy", "kl", "entropy", "response_length", "timing"}
    assert {p.stem for p in (tmp_path / "plots").glob("*.png")} == names
    first = (tmp_path / "plots" / "reward.png").stat().st_mtime_ns
    tracker.log(step_metrics(4), step=4)
    tracker.close()  # close re-renders with step 4
    assert (tmp_path / "plots" / "reward.png").stat().st_mtime_ns > first
    for png in (tmp_path / "plots").glob("*.png"):
        assert png.read_bytes()[:8] == PNG_MAGIC
    assert not list((tmp_path / "plots").glob(".*tmp"))


@pytest.mark.parametrize(
    ("steps_since", "plot_every", "last_render_s", "since_render_s", "due"),
    [
        (5, 0, 0.0, 100.0, False),  # plot_every 0: only at close
        (4, 5, 0.0, 100.0, False),  # too few steps since the last render
        (5, 5, 0.0, 0.0, True),  # the first render: none to budget
        (5, 5, 1.0, 5.0, False),  # 1 s of 6 s would be plots: more than a tenth
        (30, 5, 1.0, 5.0, False),  # more steps do not lift the budget
        (5, 5, 1.0, 9.0, True),  # 1 s of 10 s: a tenth
        (7, 5, 0.5, 60.0, True),
    ],
)
def test_plots_are_due_after_plot_every_steps_within_a_tenth_of_the_time(
    steps_since, plot_every, last_render_s, since_render_s, due
):
    assert plots_due(steps_since, plot_every, last_render_s, since_render_s) is due


def test_without_the_plots_backend_no_plot_is_drawn(tmp_path):
    tracker = Tracking(tmp_path, backends=["console"], plot_every=1)
    tracker.log(step_metrics(1), step=1)
    tracker.close()
    assert (tmp_path / "metrics.jsonl").is_file()
    assert not (tmp_path / "plots").exists()


def test_plot_patterns_select_the_intended_metrics():
    history = [
        {
            "step": 1,
            **step_metrics(1),
            "kl/mean": 0.2,
            "actor/kl_loss": 0.1,
            "critic/vf_loss": 1.0,
            "actor/pg_loss": 0.2,
            "val/arith/accuracy": 0.4,
            "mismatch/kl_k3": 0.01,
            "mismatch/log_prob_abs_diff_max": 0.3,
        }
    ]
    by_name = {spec.name: matching_keys(history, spec.pattern) for spec in PLOTS}
    assert by_name["reward"] == ["reward/mean"]
    assert by_name["val_accuracy"] == ["val/accuracy", "val/arith/accuracy"]
    assert by_name["kl"] == ["actor/ppo_kl", "kl/mean", "actor/kl_loss"]
    assert by_name["entropy"] == ["actor/entropy"]
    assert by_name["timing"] == ["timing/gen", "timing/update_actor"]
    assert by_name["loss"] == ["critic/vf_loss", "actor/pg_loss"]  # the KL loss is on the KL plot
    assert by_name["mismatch"] == ["mismatch/kl_k3", "mismatch/log_prob_abs_diff_max"]  # not on the KL plot


def test_plot_metrics_file_from_a_finished_run(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward/mean": 0.5}) + "\n")
    assert [p.name for p in plot_metrics_file(tmp_path)] == ["reward.png"]
    with pytest.raises(ValueError, match="has no metrics to plot"):
        plot_metrics_file(tmp_path / "empty")


def test_resume_keeps_earlier_bytes_appends_and_cuts_only_rows_after_the_resume_step(tmp_path):
    tracker = Tracking(tmp_path, backends=[], plot_every=0)
    for step in range(1, 6):
        tracker.log({"x": float(step)}, step=step)
    tracker.close()
    before = (tmp_path / "metrics.jsonl").read_bytes()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "x": ')  # the interrupted run was killed mid-line
    inode = (tmp_path / "metrics.jsonl").stat().st_ino
    resumed = Tracking(tmp_path, backends=[], plot_every=0, resume_step=3)
    assert [r["step"] for r in resumed.history] == [1, 2, 3]
    resumed.log({"x": 40.0}, step=4)
    resumed.close()
    after = (tmp_path / "metrics.jsonl").read_bytes()
    rows_1_to_3 = b"".join(before.splitlines(keepends=True)[:3])
    assert after.startswith(rows_1_to_3)  # untouched: appended to, not rewritten
    assert (tmp_path / "metrics.jsonl").stat().st_ino == inode
    assert [(r["step"], r["x"]) for r in read_metrics(tmp_path / "metrics.jsonl")] == [
        (1, 1.0),
        (2, 2.0),
        (3, 3.0),
        (4, 40.0),
    ]


def test_fresh_start_moves_an_earlier_metrics_file_aside(tmp_path, capsys):
    for value in (1.0, 2.0):
        tracker = Tracking(tmp_path, backends=[], plot_every=0)
        tracker.log({"x": value}, step=1)
        tracker.close()
    assert read_metrics(tmp_path / "metrics.jsonl") == [{"step": 1, "x": 2.0}]
    assert read_metrics(tmp_path / "metrics.jsonl.1") == [{"step": 1, "x": 1.0}]
    assert "fresh start: moved the earlier metrics.jsonl to metrics.jsonl.1" in capsys.readouterr().out


def test_tensorboard_scalars_and_purge_on_resume(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tracker = Tracking(tmp_path, backends=["tensorboard"], plot_every=0)
    for step in range(1, 4):
        tracker.log({"reward/mean": float(step)}, step=step)
    tracker.close()
    resumed = Tracking(tmp_path, backends=["tensorboard"], plot_every=0, resume_step=1)
    resumed.log({"reward/mean": 20.0}, step=2)
    resumed.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("reward/mean")] == [(1, 1.0), (2, 20.0)]
