"""A working tree laid out as `make quickstart` leaves it, for the tests that read the shipped
recipes in-process.

The shipped recipes name paths relative to the working directory: outputs/quickstart/...,
outputs/tool_demo/... (what the quickstart and the tool demo write), data/gsm8k/... (what
scripts/prepare_gsm8k.py writes) and models/... (where the GPU recipes expect a model). A test
that passed only while those paths were absent would pass on a fresh clone and fail after
`make quickstart`, the README's own order. The tests that load a shipped recipe in-process run
with this tree as their working directory (conftest's `in_quickstart_working_tree`), so every run
of the suite, CI's fresh clone included, sees those paths present, and none reads the
repository's own outputs/.
"""

from pathlib import Path

from hybridflow.config.loader import load_recipe, to_dict
from hybridflow.data.arith import ArithConfig, write_arith_parquet
from hybridflow.trainer.checkpoint import CheckpointManager, save_trainer_state
from hybridflow.utils.tiny_model import make_tiny_model

ROOT = Path(__file__).resolve().parents[1]
# (recipe, the stage's model directory) of each stage a quickstart script runs
STAGES = {
    "quickstart_sft": "outputs/quickstart/tiny_model",
    "quickstart": "outputs/quickstart/sft/hf",
    "tool_demo_sft": "outputs/tool_demo/tiny_model",
    "tool_demo": "outputs/tool_demo/sft/hf",
}
# the final exports, and the local model directories the GPU recipes name
MODELS = (
    "outputs/quickstart/grpo/hf",
    "outputs/tool_demo/grpo/hf",
    "models/Qwen2.5-0.5B-Instruct",
    "models/Qwen3-4B",
    "models/Qwen3-30B-A3B",
)


def build_quickstart_working_tree(root: Path) -> Path:
    """`root` holding what the quickstart, the tool demo and scripts/prepare_gsm8k.py leave: models
    (one tiny model, linked), parquet rows, each stage's resolved recipe, export and last
    checkpoint. Returns `root`."""
    model = make_tiny_model(root / ".tiny_model")
    for directory in (*STAGES.values(), *MODELS):
        link(root / directory, model)
    for data in ("outputs/quickstart/data", "outputs/tool_demo/data", "data/gsm8k"):
        write_arith_parquet(root / data, ArithConfig(num_train=16, num_test=8))
    for recipe in STAGES:
        finished_stage(root, recipe)
    return root


def link(path: Path, target: Path) -> None:
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.symlink_to(target.resolve(), target_is_directory=True)


def finished_stage(root: Path, recipe: str) -> None:
    """The stage's output_dir as a finished run leaves it: config.yaml and a complete checkpoint
    of its last step (a resume from it finds nothing to do)."""
    cfg = load_recipe(ROOT / "recipes" / f"{recipe}.yaml")
    out = root / cfg.trainer.output_dir
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text((ROOT / "recipes" / f"{recipe}.yaml").read_text())
    step = cfg.trainer.total_training_steps or 1

    def write(directory: Path) -> None:
        (directory / "actor").mkdir()
        (directory / "actor" / "shard.bin").write_bytes(b"w")
        position = {"epoch": 0, "batch_index": step, "seed": cfg.data.seed}
        save_trainer_state(directory / "trainer_state.pt", step, position, to_dict(cfg))

    CheckpointManager(out / "checkpoints").save(step, write, ["actor", "trainer_state.pt"])
