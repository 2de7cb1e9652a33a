"""The layer rules from docs/design.md: `import hybridflow` stays light, and engines never import
the controller layers."""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HEAVY_MODULES = ("megatron", "sglang", "vllm", "transformer_engine")
CONTROLLER_PACKAGES = (
    "hybridflow.trainer",
    "hybridflow.workers",
    "hybridflow.single_controller",
    "hybridflow.config",
)


def test_import_hybridflow_does_not_import_megatron_sglang_or_cuda():
    probe = (
        "import sys, hybridflow, hybridflow.protocol;"
        f"heavy = [m for m in sys.modules if m.split('.')[0] in {HEAVY_MODULES!r}];"
        "import torch;"
        "print(heavy, torch.cuda.is_initialized())"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[] False", out.stdout + out.stderr


def _imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_engines_never_import_controller_layers():
    offenders = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in sorted((ROOT / "engines").rglob("*.py"))
        for name in _imported_modules(path)
        if name.startswith(CONTROLLER_PACKAGES)
    ]
    assert offenders == []


def test_only_engines_import_megatron_or_sglang():
    offenders = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in sorted((ROOT / "hybridflow").rglob("*.py"))
        for name in _imported_modules(path)
        if name.split(".")[0] in HEAVY_MODULES
    ]
    assert offenders == []


def test_the_in_process_path_imports_no_ray():
    """scripts/gpu_check.sh trains through LocalWorkerGroup on GPU machines that have no Ray."""
    probe = (
        "import sys; sys.modules['ray'] = None;"  # every `import ray` now fails
        "import hybridflow.trainer.ppo_trainer, hybridflow.workers.actor_rollout_ref;"
        "from hybridflow.single_controller import LocalWorkerGroup, RayClassWithInitArgs, Worker;"
        "print('no ray needed')"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert out.stdout.strip() == "no ray needed", out.stderr[-3000:]
