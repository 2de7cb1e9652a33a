"""The layer rules from docs/design.md: `import hybridflow` stays light, and engines import from
hybridflow only what the allow-list names (import cycles: test_import_cycles.py)."""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HEAVY_MODULES = ("megatron", "sglang", "vllm", "transformer_engine")
# All that engines/ may import from hybridflow (these modules and, for a package, its submodules).
ENGINE_IMPORTS_FROM_HYBRIDFLOW = ("hybridflow.protocol", "hybridflow.algorithms", "hybridflow.parallel_ranks")
# Attributes and Ray calls that reach a worker group's Ray actors: only hybridflow/single_controller/
# uses them; elsewhere a group is driven through its methods (call_rank_async, kill_rank, ...).
ACTOR_ATTRIBUTES = {"actors", "_actors", "remote"}
RAY_ACTOR_CALLS = {"kill", "get_actor"}


def test_import_hybridflow_does_not_import_megatron_sglang_or_cuda():
    probe = (
        "import sys, hybridflow, hybridflow.protocol;"
        f"heavy = [m for m in sys.modules if m.split('.')[0] in {HEAVY_MODULES!r}];"
        "import torch;"
        "print(heavy, torch.cuda.is_initialized())"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[] False", out.stdout + out.stderr


def _imported_names(path: Path) -> set[str]:
    """What each import statement names, `from a.b import c` as `a.b.c` (c a module or not)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def _allowed_in_engines(name: str) -> bool:
    return f"{name}.".startswith(tuple(f"{allowed}." for allowed in ENGINE_IMPORTS_FROM_HYBRIDFLOW))


def test_engines_import_from_hybridflow_only_the_allow_listed_modules():
    offenders = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in sorted((ROOT / "engines").rglob("*.py"))
        for name in _imported_names(path)
        if name.split(".")[0] == "hybridflow" and not _allowed_in_engines(name)
    ]
    assert offenders == []


def test_the_allow_listed_modules_exist():
    for name in ENGINE_IMPORTS_FROM_HYBRIDFLOW:
        path = ROOT.joinpath(*name.split("."))
        assert path.with_suffix(".py").is_file() or (path / "__init__.py").is_file(), name


def _actor_handle_uses(path: Path) -> list[str]:
    uses = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if not isinstance(node, ast.Attribute):
            continue
        on_ray = isinstance(node.value, ast.Name) and node.value.id == "ray"
        if node.attr in ACTOR_ATTRIBUTES or (on_ray and node.attr in RAY_ACTOR_CALLS):
            uses.append(f"{path.relative_to(ROOT)}:{node.lineno} .{node.attr}")
    return uses


def test_only_the_single_controller_touches_ray_actor_handles():
    product = sorted((ROOT / "hybridflow").rglob("*.py")) + sorted((ROOT / "engines").rglob("*.py"))
    outside = [path for path in product if "single_controller" not in path.relative_to(ROOT).parts]
    assert [use for path in outside for use in _actor_handle_uses(path)] == []


def test_only_engines_import_megatron_or_sglang():
    offenders = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in sorted((ROOT / "hybridflow").rglob("*.py"))
        for name in _imported_names(path)
        if name.split(".")[0] in HEAVY_MODULES
    ]
    assert offenders == []


def test_the_in_process_path_imports_no_ray():
    """scripts/gpu_check.sh trains through LocalWorkerGroup on GPU machines that have no Ray."""
    probe = (
        "import sys; sys.modules['ray'] = None;"  # every `import ray` now fails
        "import hybridflow.trainer.ppo_trainer, hybridflow.workers.hybrid_policy;"
        "from hybridflow.single_controller import LocalWorkerGroup, RayClassWithInitArgs, Worker;"
        "print('no ray needed')"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert out.stdout.strip() == "no ray needed", out.stderr[-3000:]


def test_checking_a_recipe_imports_no_engine_library(tmp_path):
    """The driver checks every recipe before anything starts; it builds no model, so importing
    Megatron-Core or vLLM there would only cost every run seconds of CPU (the workers import them)."""
    from hybridflow.data.arith import ArithConfig, write_arith_parquet
    from hybridflow.utils.tiny_model import make_tiny_model

    model = make_tiny_model(tmp_path / "tiny", num_layers=2)
    data = write_arith_parquet(tmp_path / "data", ArithConfig(num_train=32, num_test=4))
    argv = [
        str(ROOT / "recipes/quickstart.yaml"), f"model.path={model}", "rollout.name=vllm",
        f"data.train_files=[{data['train']}]", f"data.val_files=[{data['test']}]",
        "critic.enable=true", "algorithm.adv_estimator=gae", f"trainer.output_dir={tmp_path / 'out'}",
    ]  # fmt: skip
    probe = (
        "import sys; from hybridflow.trainer.main import checked_recipe;"
        f"checked_recipe({argv!r});"
        f"print([m for m in sys.modules if m.split('.')[0] in {HEAVY_MODULES!r}])"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=tmp_path)
    assert out.stdout.strip().splitlines()[-1:] == ["[]"], out.stdout + out.stderr
