"""The layer rules from docs/design.md: which part of the code may import which (an allow-list:
the layer table under docs/design.md's picture, read from there), only the single controller
touches Ray actors, and `import hybridflow` stays light (import cycles: test_import_cycles.py)."""

import ast
import functools
import itertools
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HEAVY_MODULES = ("megatron", "sglang", "vllm", "transformer_engine")
# The bottom layer ("base"): all that engines/ may import from hybridflow (these modules and, for a
# package, its submodules).
BASE = ("hybridflow.protocol", "hybridflow.algorithms", "hybridflow.parallel_ranks")
LAYERS_TABLE = "<!-- layers: part | may import -->"  # in docs/design.md, above the table


def _may_import() -> dict[str, set[str]]:
    """Each part -> the parts it may import besides itself: docs/design.md's layer table. A part is
    `engines`, `base`, a subpackage of hybridflow, or `hybridflow` (the package's __init__)."""
    rows = (ROOT / "docs/design.md").read_text().split(LAYERS_TABLE, 1)[1].splitlines()[3:]
    table = {}
    for row in itertools.takewhile(lambda line: line.startswith("|"), rows):
        part, allowed = row.strip("|").split("|")
        table[part.split("`")[1]] = {name.strip() for name in allowed.split(",") if name.strip()}
    return table


MAY_IMPORT = _may_import()
# Attributes and Ray calls that reach a worker group's Ray actors: only hybridflow/single_controller/
# uses them; elsewhere a group is driven through its methods (call_rank_async, kill_rank, ...).
ACTOR_ATTRIBUTES = {"actors", "_actors", "remote"}
RAY_ACTOR_CALLS = {"kill", "get_actor"}


def _product_files() -> list[Path]:
    return sorted((ROOT / "hybridflow").rglob("*.py")) + sorted((ROOT / "engines").rglob("*.py"))


def _module_of(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _part(module: str) -> str | None:
    """The part a module (or a name imported from one) belongs to; None outside the project."""
    names = module.split(".")
    if names[0] == "engines":
        return "engines"
    if names[0] != "hybridflow":
        return None
    if f"{module}.".startswith(tuple(f"{base}." for base in BASE)):
        return "base"
    return names[1] if len(names) > 1 else "hybridflow"


def test_import_hybridflow_does_not_import_megatron_sglang_or_cuda():
    probe = (
        "import sys, hybridflow, hybridflow.protocol;"
        f"heavy = [m for m in sys.modules if m.split('.')[0] in {HEAVY_MODULES!r}];"
        "import torch;"
        "print(heavy, torch.cuda.is_initialized())"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[] False", out.stdout + out.stderr


@functools.cache
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def _imported_names(path: Path) -> set[str]:
    """What each import statement names, `from a.b import c` as `a.b.c` (c a module or not)."""
    names = set()
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def _import_offenders(path: Path) -> list[str]:
    here = _part(_module_of(path))
    return [
        f"{path.relative_to(ROOT)} ({here}) imports {name} ({_part(name)})"
        for name in sorted(_imported_names(path))
        if _part(name) not in {None, here} and _part(name) not in MAY_IMPORT.get(here, set())
    ]


def test_every_part_imports_only_the_parts_below_it():
    assert [offender for path in _product_files() for offender in _import_offenders(path)] == []


def test_every_part_has_its_place_in_the_allow_list():
    parts = {_part(_module_of(path)) for path in _product_files()}
    assert parts - set(MAY_IMPORT) == set(), "give the new part its row in docs/design.md's layer table"
    assert all(imported in MAY_IMPORT for allowed in MAY_IMPORT.values() for imported in allowed)


def test_the_allow_list_has_no_cycle():
    placed: list[str] = []  # bottom up: a part after every part it may import
    while len(placed) < len(MAY_IMPORT):
        ready = [part for part, below in MAY_IMPORT.items() if part not in placed and below <= set(placed)]
        assert ready, f"a cycle among {set(MAY_IMPORT) - set(placed)}"
        placed += ready


def test_the_modules_named_here_exist():
    """The base modules."""
    for name in BASE:
        path = ROOT.joinpath(*name.split("."))
        assert path.with_suffix(".py").is_file() or (path / "__init__.py").is_file(), name


def _actor_handle_uses(path: Path) -> list[str]:
    uses = []
    for node in ast.walk(_tree(path)):
        if not isinstance(node, ast.Attribute):
            continue
        on_ray = isinstance(node.value, ast.Name) and node.value.id == "ray"
        if node.attr in ACTOR_ATTRIBUTES or (on_ray and node.attr in RAY_ACTOR_CALLS):
            uses.append(f"{path.relative_to(ROOT)}:{node.lineno} .{node.attr}")
    return uses


def test_only_the_single_controller_touches_ray_actor_handles():
    outside = [path for path in _product_files() if "single_controller" not in path.relative_to(ROOT).parts]
    assert [use for path in outside for use in _actor_handle_uses(path)] == []


def test_the_trainer_imports_no_megatron_engine_module():
    """The loop reaches the Megatron engine through its workers; what runs before them reads the
    engine's modules from hybridflow/checks/."""
    trainer = sorted((ROOT / "hybridflow/trainer").rglob("*.py"))
    assert [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in trainer
        for name in sorted(_imported_names(path))
        if f"{name}.".startswith("engines.megatron.")
    ] == []


def test_product_code_holds_no_test_hooks():
    """A test that needs a worker to behave otherwise brings its own code (a worker or engine class,
    tests/async_rl/hung_workers.py; a hook loaded on the run's path, tests/async_rl/held_calls/)."""
    hooked = [path for path in _product_files() if "HYBRIDFLOW_TEST_" in path.read_text()]
    assert [str(path.relative_to(ROOT)) for path in hooked] == []


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
