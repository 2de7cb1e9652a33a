"""Every row of the table in docs/bad-inputs.md, run through the real entry point.

Each row is a command line (`python -m hybridflow.trainer.main <args>`) whose `<name>` parts are
files this module builds once (a valid tiny recipe, broken copies of a tiny model, broken
parquet files, a broken checkpoint folder). Each must exit with status 2 and one `error:` line
holding the table's message, no traceback, and Ray never started: in-process, `connect_ray` and
`ray.init` are replaced by a function that fails the test (a control test shows the valid recipe
does reach it); in a subprocess, RAY_TMPDIR is a fresh folder Ray would write its session into.
"""

import functools
import json
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from chat_template_stand_ins import BARE_JSON_CALLS, NO_TOOL_ROLE
from entry_point_checks import RayStarted, base_recipe, run_in_process
from process_group import run_in_own_session
from safetensors import safe_open

from hybridflow.checks.data import check_reward_inputs
from hybridflow.config.loader import load_recipe, to_dict, write_resolved_recipe
from hybridflow.data.arith import ArithConfig, write_arith_parquet
from hybridflow.data.shapes import ShapesConfig, write_shapes_parquet
from hybridflow.trainer.checkpoint import CheckpointManager, save_trainer_state
from hybridflow.utils.tiny_model import build_tokenizer, make_tiny_model
from hybridflow.utils.tiny_vlm import make_tiny_vlm

# the shipped recipes' relative paths exist, as after `make quickstart` (tests/working_tree.py)
pytestmark = pytest.mark.usefixtures("in_quickstart_working_tree")

ROOT = Path(__file__).resolve().parents[1]
TABLE = ROOT / "docs" / "bad-inputs.md"
ROW = re.compile(r"^\| (?P<case>[^|`]+?) \| `(?P<command>[^`]+)` \| `(?P<message>[^`]+)` \|$")
INDEX = "model.safetensors.index.json"
SUBPROCESS_CASES = ("YAML syntax error", "prompt is null")  # the cheapest and the deepest check


def table_rows() -> list[tuple[str, str, str]]:
    rows = [ROW.match(line) for line in TABLE.read_text().splitlines()]
    return [(m["case"], m["command"], m["message"]) for m in rows if m]


def model_copy(
    tiny: Path, out: Path, drop: tuple[str, ...] = (), write: dict[str, bytes] | None = None
) -> Path:
    """`tiny` with some files left out or replaced (the others are symlinks: nothing is copied)."""
    out.mkdir()
    for file in tiny.iterdir():
        if file.name not in drop and file.name not in (write or {}):
            (out / file.name).symlink_to(file)
    for name, content in (write or {}).items():
        (out / name).write_bytes(content)
    return out


def write_rows(path: Path, rows: list[dict]) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def config_with(model: Path, **changes) -> dict[str, bytes]:
    """`model`'s config.json with some values changed, as model_copy's `write` argument."""
    return {
        "config.json": json.dumps({**json.loads((model / "config.json").read_text()), **changes}).encode()
    }


def broken_models(tiny: Path, root: Path) -> dict[str, Path]:
    """Copies of the tiny model with a broken config.json, weights or tokenizer; a config.json that
    disagrees with the weights in one count each (the tiny model: vocabulary 263, hidden 128, 4
    layers, 2 KV heads; the tiny MoE: 4 experts)."""
    config = json.loads((tiny / "config.json").read_text())
    headless = json.dumps({k: v for k, v in config.items() if k != "num_attention_heads"}).encode()
    moe = make_tiny_model(root / "tiny_moe", arch="qwen3_moe", num_layers=2, num_experts=4)
    weights = (tiny / "model.safetensors").read_bytes()
    with safe_open(tiny / "model.safetensors", framework="pt") as handle:
        names = list(handle.keys())
    index = {"weight_map": dict.fromkeys(names, "model.safetensors")}
    shard_missing = {"weight_map": {**index["weight_map"], names[-1]: "model-00002-of-00002.safetensors"}}
    tokenizer = tuple(f.name for f in tiny.iterdir() if f.name.startswith(("tokenizer", "vocab", "merges")))
    variants = {
        "config_not_json": {"write": {"config.json": b"{not json"}},
        "config_no_heads": {"write": {"config.json": headless}},
        "weights_truncated": {"write": {"model.safetensors": weights[: len(weights) // 2]}},
        "weights_garbage": {"write": {"model.safetensors": b"garbage!" * 512}},
        "weights_absent": {"drop": ("model.safetensors",)},
        "sharded": {"write": {INDEX: json.dumps(index).encode()}},  # valid: an export's layout
        "shard_missing": {"write": {INDEX: json.dumps(shard_missing).encode()}},
        "tokenizer_absent": {"drop": tokenizer},
        "vocab_mismatch": {"write": config_with(tiny, vocab_size=200)},
        "hidden_mismatch": {"write": config_with(tiny, hidden_size=64)},
        "kv_heads_mismatch": {"write": config_with(tiny, num_key_value_heads=1)},
        "layers_fewer_in_config": {"write": config_with(tiny, num_hidden_layers=2)},
        "layers_more_in_config": {"write": config_with(tiny, num_hidden_layers=6)},
    }
    models = {name: model_copy(tiny, root / name, **how) for name, how in variants.items()}
    models["experts_mismatch"] = model_copy(
        moe, root / "experts_mismatch", write=config_with(moe, num_experts=2)
    )
    return models


def broken_parquets(rows: list[dict], out: Path) -> dict[str, Path]:
    """Parquet files that break one rule each, made from valid rows."""
    out.mkdir()
    variants = {
        "null_prompt": [rows[0], {**rows[1], "prompt": None}],
        "empty_prompt": [rows[0], {**rows[1], "prompt": []}],
        "string_prompt": [{**r, "prompt": r["prompt"][0]["content"]} for r in rows],  # one type a column
        "no_answer": [{**r, "extra_info": {**r["extra_info"], "answer": None}} for r in rows],
        "unknown_source": [{**r, "data_source": "mystery"} for r in rows],
        "no_ground_truth": [{**r, "reward_model": {"style": "rule", "ground_truth": None}} for r in rows],
    }
    files = {f"{name}.parquet": write_rows(out / f"{name}.parquet", bad) for name, bad in variants.items()}
    files["no_prompt.parquet"] = out / "no_prompt.parquet"
    pq.write_table(pa.Table.from_pylist(rows).drop(["prompt"]), files["no_prompt.parquet"])
    files["images.parquet"] = out / "images.parquet"  # the rows and a column of images (PNG bytes)
    png = {"bytes": b"\x89PNG\r\n\x1a\n", "path": None}  # never decoded: the column's presence is refused
    pq.write_table(pa.Table.from_pylist([{**r, "images": [png]} for r in rows]), files["images.parquet"])
    files["empty.parquet"] = out / "empty.parquet"
    pq.write_table(pa.Table.from_pylist(rows).slice(0, 0), files["empty.parquet"])
    files["not_parquet.parquet"] = out / "not_parquet.parquet"
    files["not_parquet.parquet"].write_text("question,answer\n1+1,2\n")
    return files


def broken_recipes_and_checkpoints(root: Path) -> dict[str, Path]:
    files = {"bad_syntax.yaml": root / "bad_syntax.yaml", "list.yaml": root / "list.yaml"}
    files["bad_syntax.yaml"].write_text("model:\n  path: [unclosed\ndata:\n  train_batch_size: 4\n")
    files["list.yaml"].write_text("- model\n- data\n")
    files["garbage_latest"] = root / "garbage_latest"  # an output_dir
    (files["garbage_latest"] / "checkpoints").mkdir(parents=True)
    (files["garbage_latest"] / "checkpoints" / "latest").write_text("\x00\x17garbage")
    files["unfinished_ckpt"] = root / "ckpt" / "global_step_3"  # no manifest.json
    (files["unfinished_ckpt"] / "actor").mkdir(parents=True)
    files["a_file"] = root / "a_file.txt"  # where a directory setting expects a directory
    files["a_file"].write_text("not a directory\n")
    files["a_dir"] = root / "a_dir"  # where a parquet file is expected
    files["a_dir"].mkdir()
    return files


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Every `<name>` the table uses, built once for the module."""
    root = tmp_path_factory.mktemp("bad_inputs")
    files = {"tiny": make_tiny_model(root / "tiny"), "out": root / "out", "missing": root / "missing"}
    files["vlm"] = make_tiny_vlm(root / "vlm")
    files["shapes"] = write_shapes_parquet(root / "shapes", ShapesConfig(num_train=8, num_test=4))["train"]
    files.update(write_arith_parquet(root / "data", ArithConfig(num_train=8, num_test=4, seed=3)))
    files.update(broken_models(files["tiny"], root))
    files["tiny_moe"] = root / "tiny_moe"  # broken_models' mixture-of-experts model, as it was made
    files.update(broken_parquets(pq.read_table(files["train"]).to_pylist(), root / "bad_data"))
    files.update(broken_recipes_and_checkpoints(root))
    files["recipe"] = root / "recipe.yaml"
    files["recipe"].write_text(yaml.safe_dump(base_recipe(files)))
    files.update(finished_runs(files["recipe"], root))
    files.update(agent_inputs(files["tiny"], root))
    files.update(teacher_inputs(files["tiny"], root))
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(files["modules"]))  # the probe modules import by name
        yield files


# Modules a recipe names by dotted path, failing as user code does (put on sys.path by run_in_process)
PROBE_MODULES = {
    "probe_raising_tool": 'raise RuntimeError("no GPU is visible to this tool\\nmore detail")\n',
    "probe_refusing_tool": (
        "class Sandbox:\n    def __init__(self):\n"
        '        raise OSError("landlock: the kernel refused the ruleset")\n'
    ),
    "probe_raising_reward": 'raise RuntimeError("the reward service is unreachable")\n',
}


def agent_inputs(tiny: Path, root: Path) -> dict[str, Path]:
    """The probe modules, the tiny model with chat templates an agent loop cannot use, and a tiny
    model of head size 16 (vLLM's CPU attention has none)."""
    modules = root / "modules"
    modules.mkdir()
    for name, source in PROBE_MODULES.items():
        (modules / f"{name}.py").write_text(source)
    templates = {"template_no_tool_role": NO_TOOL_ROLE, "template_bare_json_calls": BARE_JSON_CALLS}
    files = {
        name: model_copy(tiny, root / name, write={"chat_template.jinja": t.encode()})
        for name, t in templates.items()
    }
    return {
        **files,
        "modules": modules,
        "narrow_heads": make_tiny_model(root / "narrow_heads", hidden_size=64),
    }


def teacher_inputs(tiny: Path, root: Path) -> dict[str, Path]:
    """The tiny model with a tokenizer of one more token: a distillation teacher that does not share
    the student's tokenizer."""
    tokenizer_files = tuple(
        f.name for f in tiny.iterdir() if f.name.startswith(("tokenizer", "vocab", "merges"))
    )
    other = model_copy(tiny, root / "teacher_other_tokenizer", drop=(*tokenizer_files, "chat_template.jinja"))
    tokenizer = build_tokenizer()
    tokenizer.add_tokens(["<|teacher|>"])
    tokenizer.save_pretrained(other)
    return {"teacher_other_tokenizer": other}


# the runs whose checkpoints the resume rows continue: the valid recipe, and it generating ahead
FINISHED_RUNS = {
    "resumable": [],
    "resumable_one_step": [
        "trainer.placement=disaggregated",
        "trainer.rollout_pool.n_gpus_per_node=1",
        "trainer.async_training.mode=one_step",
    ],
}


def finished_runs(recipe: Path, root: Path) -> dict[str, Path]:
    """Output directories holding a complete checkpoint of `recipe` (with FINISHED_RUNS' changes)
    and its config.yaml, as a run that saved at step 2 leaves them."""
    runs = {}
    for name, overrides in FINISHED_RUNS.items():
        runs[name] = root / name
        cfg = load_recipe(recipe, [*overrides, f"trainer.output_dir={runs[name]}"])
        write_resolved_recipe(cfg, runs[name])
        write = functools.partial(write_checkpoint, config=to_dict(cfg))
        CheckpointManager(runs[name] / "checkpoints").save(2, write, ["actor", "trainer_state.pt"])
    return runs


def write_checkpoint(directory: Path, config: dict) -> None:
    (directory / "actor").mkdir()
    (directory / "actor" / "shard.bin").write_bytes(b"w")
    save_trainer_state(directory / "trainer_state.pt", 2, {"epoch": 0, "batch_index": 2}, config)


def resolve(text: str, files: dict[str, Path]) -> str:
    return re.sub(r"<([\w.]+)>", lambda m: str(files[m.group(1)]), text)


CASES = table_rows()


def test_the_probe_of_async_agents_lora_and_vllm_lists_at_least_25_cases():
    text = TABLE.read_text()
    section = text[
        text.index("## Async training, agents, LoRA and vLLM") : text.index("## Faults during a run")
    ]
    assert len([line for line in section.splitlines() if ROW.match(line)]) >= 25


def test_the_table_lists_at_least_35_distinct_bad_inputs():
    assert len(CASES) >= 35
    assert len({case for case, _, _ in CASES}) == len(CASES)
    assert set(SUBPROCESS_CASES) <= {case for case, _, _ in CASES}


DISTILL = ["algorithm.distillation.enable=true", "teacher.path=<tiny>"]


@pytest.fixture
def out_config(files) -> Iterator[Path]:
    """The config.yaml a run writes into the shared output folder once its checks pass; removed
    after each test, so a case that wrongly passes the checks fails alone, not the cases after it."""
    config = files["out"] / "config.yaml"
    yield config
    config.unlink(missing_ok=True)


@pytest.mark.parametrize(
    "overrides",
    [
        [],
        ["trainer.mode=sft"],
        ["model.path=<sharded>"],
        ["algorithm.adv_estimator=gae", "critic.enable=true"],
        [*DISTILL, "teacher.megatron.tensor_model_parallel_size=2"],  # in the actor's processes
        [*DISTILL, "trainer.n_gpus_per_node=3", "teacher.n_gpus_per_node=1"],  # a pool of its own
        [
            "model.path=<vlm>",
            "data.train_files=[<shapes>]",
            "data.val_files=[<shapes>]",
            "data.max_prompt_length=64",
        ],
    ],
)
def test_the_valid_recipe_gets_as_far_as_ray(overrides, files, out_config, monkeypatch, capsys):
    """The control: without a bad input the same checks pass and the entry point goes on to Ray,
    so each row below fails because of its own input, before that point. (`<sharded>` is the
    tiny model with a safetensors index, the layout of an export.)"""
    with pytest.raises(RayStarted):
        run_in_process([str(files["recipe"]), *(resolve(o, files) for o in overrides)], monkeypatch, capsys)
    assert out_config.is_file()


@pytest.mark.parametrize(("case", "command", "message"), CASES, ids=[case for case, _, _ in CASES])
def test_bad_input_fails_with_one_error_before_ray(
    case, command, message, files, out_config, monkeypatch, capsys
):
    argv = [resolve(arg, files) for arg in shlex.split(command)]
    code, err = run_in_process(argv, monkeypatch, capsys)
    assert code == 2, err
    assert "Traceback" not in err
    assert len([line for line in err.splitlines() if line.startswith("error: ")]) == 1, err
    error = err[err.index("error: ") :]
    assert "\n  - " not in error, error  # one problem, one line
    assert resolve(message, files) in error
    assert not out_config.exists()  # nothing written before the checks pass


@pytest.mark.parametrize("case", SUBPROCESS_CASES)
def test_entry_point_exits_2_without_traceback_or_ray_session(case, files, tmp_path):
    """`python -m hybridflow.trainer.main` itself; Ray would create a session folder in RAY_TMPDIR."""
    command, message = next((c, m) for name, c, m in CASES if name == case)
    ray_tmp = tmp_path / "ray"
    ray_tmp.mkdir()
    done = run_in_own_session(
        [sys.executable, "-m", "hybridflow.trainer.main", *(resolve(a, files) for a in shlex.split(command))],
        cwd=ROOT,
        env={**os.environ, "RAY_TMPDIR": str(ray_tmp), "RAY_ADDRESS": ""},
        timeout=300,
    )
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert resolve(message, files) in done.stderr
    assert list(ray_tmp.iterdir()) == []


def test_missing_ground_truths_are_an_error_for_the_rule_reward_and_a_warning_for_a_custom_one(caplog):
    def row(truth):
        return {"data_source": "arith", "reward_model": {"style": "rule", "ground_truth": truth}}

    some = [("f.parquet row 0", row(None)), ("f.parquet row 1", row("3"))]
    check_reward_inputs(some, custom_fn=None)
    assert "ground_truth is null in 1 of 2 rows, e.g. f.parquet row 0" in caplog.text
    none = [("f.parquet row 0", row(None)), ("f.parquet row 1", row(None))]
    with pytest.raises(ValueError, match=r"null in every row \(f.parquet row 0 ... f.parquet row 1\)"):
        check_reward_inputs(none, custom_fn=None)
    caplog.clear()
    check_reward_inputs(none, custom_fn="my_rewards.score")
    assert "ground_truth is null in 2 of 2 rows" in caplog.text


def test_an_output_filesystem_smaller_than_one_checkpoint_is_warned_about_before_ray(
    files, tmp_path, monkeypatch, capsys, caplog
):
    """A 4 MiB tmpfs; one checkpoint of the tiny model (4 layers, ~1 M parameters x 12 bytes of
    fp32 weights and Adam moments) takes about 12 MiB. A warning, not an error: space may be freed
    before the first save."""
    mount_point = tmp_path / "small"
    mount_point.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount_point)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        argv = [str(files["recipe"]), f"trainer.output_dir={mount_point / 'run'}"]
        with pytest.raises(RayStarted):
            run_in_process([*argv, "trainer.save_freq=0"], monkeypatch, capsys)
        assert "one checkpoint" not in caplog.text  # nothing is saved: nothing to warn about
        with pytest.raises(RayStarted):
            run_in_process([*argv, "trainer.save_freq=5"], monkeypatch, capsys)
        assert (
            f"trainer.output_dir={mount_point / 'run'} has 4.0 MiB free, but one checkpoint "
            "(trainer.save_freq=5) needs about 12." in caplog.text
        )
        assert "the first save will fail with 'No space left on device'" in caplog.text
    finally:
        subprocess.run(["umount", "--lazy", str(mount_point)], check=False)


def test_a_refused_resume_leaves_the_run_directory_as_it_was(files, monkeypatch, capsys):
    """The recipe change is refused before the resolved recipe is written: config.yaml still
    describes the run the checkpoints belong to."""
    written = (files["resumable"] / "config.yaml").read_text()
    argv = [str(files["recipe"]), f"trainer.output_dir={files['resumable']}", "data.seed=7"]
    code, err = run_in_process(argv, monkeypatch, capsys)
    assert code == 2 and "error: cannot resume from" in err and "data.seed: 1 -> 7" in err, err
    assert (files["resumable"] / "config.yaml").read_text() == written


ASYNC = [
    "trainer.placement=disaggregated",
    "trainer.rollout_pool.n_gpus_per_node=1",
    "trainer.async_training.mode=async",
    "trainer.total_training_steps=null",  # one epoch: 8 rows in batches of 4
]


def test_a_staleness_bound_the_run_cannot_reach_is_warned_about_before_ray(
    files, monkeypatch, capsys, caplog
):
    """8 rows in batches of 4 for one epoch: 2 steps, so no sample can be more than 1 version old and
    max_staleness 4 would only generate every batch ahead from the first weights. Legal (a short smoke
    test of a long run's recipe), so a warning."""
    with pytest.raises(RayStarted):
        run_in_process(
            [str(files["recipe"]), *ASYNC, "trainer.async_training.max_staleness=1"], monkeypatch, capsys
        )
    assert "max_staleness" not in caplog.text
    with pytest.raises(RayStarted):
        run_in_process(
            [str(files["recipe"]), *ASYNC, "trainer.async_training.max_staleness=4"], monkeypatch, capsys
        )
    assert (
        "trainer.async_training.max_staleness=4 is beyond what this run reaches: it trains 2 steps, so no "
        "sample is more than 1 version(s) old" in caplog.text
    )


MOE_TP1 = ["model.path=<tiny_moe>", "actor.megatron.tensor_model_parallel_size=1"]


@pytest.mark.parametrize(
    ("switched_off", "changed", "warning"),
    [
        (
            [],
            ["algorithm.distillation.task_coef=0.5", "teacher.n_gpus_per_node=1"],
            "algorithm.distillation.task_coef=0.5, teacher.n_gpus_per_node=1 have no effect with "
            "algorithm.distillation.enable=false: set algorithm.distillation.enable=true to distil from "
            "teacher.path, or remove them",
        ),
        (
            ["rollout.calculate_log_probs=false"],
            ["trainer.mismatch_threshold=0.05"],
            "trainer.mismatch_threshold=0.05 has no effect with rollout.calculate_log_probs=false: the "
            "mismatch monitor compares the engine's log-probs, which are then not computed",
        ),
        (
            MOE_TP1,
            ["rollout.return_routed_experts=true"],
            "rollout.return_routed_experts=true records each token's experts for routing replay, but "
            "actor.megatron.moe_routing_replay=off: nothing reads them",
        ),
        (
            [],
            ["rollout.agent.max_turns=8", "rollout.agent.tool_timeout_s=5"],
            "rollout.agent.max_turns=8, rollout.agent.tool_timeout_s=5.0 have no effect with "
            "rollout.agent.loop=single_turn: only loop=tool reads them; set rollout.agent.loop=tool, or "
            "remove them",
        ),
        (
            [],
            ["rollout.server.port=8000"],
            "rollout.server.port=8000 has no effect with rollout.agent.loop=single_turn: only loop=openai "
            "serves an endpoint",
        ),
    ],
    ids=["distillation_off", "mismatch_monitor_off", "routes_not_replayed", "tool_loop_off", "endpoint_off"],
)
def test_settings_of_a_feature_switched_off_are_warned_about_before_ray(
    switched_off, changed, warning, files, out_config, monkeypatch, capsys, caplog
):
    """Legal (a recipe turned off by its one switch keeps the rest of the feature's settings), but a
    changed value there is meant to act: a warning naming the settings and the switch, and the run
    goes on. The feature switched off alone (the control) gives none."""
    argv = [str(files["recipe"]), *(resolve(o, files) for o in switched_off)]
    with pytest.raises(RayStarted):
        run_in_process(argv, monkeypatch, capsys)
    assert "no effect with" not in caplog.text and "nothing reads them" not in caplog.text
    with pytest.raises(RayStarted):
        run_in_process([*argv, *changed], monkeypatch, capsys)
    assert warning in caplog.text
    assert out_config.is_file()
