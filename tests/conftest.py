"""Fixtures shared by the whole suite: one Ray cluster per session, tiny models built locally, the
quickstart's SFT warm start."""

import os
from pathlib import Path

import pytest
from gsm8k_tiny import gsm8k_inputs, make_gsm8k_inputs
from learning_runs import RUN_TIMEOUT_S, run_sft_warm_start, warm_start_overrides
from made_once import made_once, run_shared_dir
from process_group import run_recipe_script
from recipe_runs import workers_import_from
from working_tree import build_quickstart_working_tree

from hybridflow.data.arith import write_arith_parquet
from hybridflow.launch.local_ray import start_local_ray
from hybridflow.utils.tiny_model import make_tiny_model
from hybridflow.utils.tracking import read_metrics

# Ray and torch each start thread pools sized to the machine; on 2 cores that oversubscribes.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
# Tests never download: Hub ids resolve only from caches the tests fill (tests/hub_cache.py).
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Files with a `slow` test first, each file's tests kept together and in order. `make test`
    hands out whole files to two workers in this order (`--dist loadfile --no-loadscope-reorder`):
    the minutes-long files start early and the many quick ones fill in at the end, so neither
    worker is left alone with a long file while the other has finished."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)  # stable: collection order otherwise


@pytest.fixture(scope="session")
def worker_modules(tmp_path_factory) -> Path:
    """A directory on the PYTHONPATH of the session cluster's worker processes (and, through
    run_recipe_in_process's `pythonpath`, of a run's driver): where a test writes a user's module
    that the workers import. Each module is imported once per worker process: give each its own name."""
    return tmp_path_factory.mktemp("worker_modules")


@pytest.fixture(scope="session")
def ray_cluster(worker_modules):
    """One local Ray instance for the session. Logical CPUs exceed the 2 real cores so that
    8-rank worker groups can be placed; tests that need their own cluster (multi-node
    simulation) run in a subprocess instead of shutting this one down. address="local": a new
    instance even while another test (another pytest-xdist worker) runs a `ray start` head; a start
    that timed out on a busy machine is tried again (hybridflow/launch/local_ray.py). Its workers
    import the test agents' modules and those of `worker_modules` (tests/recipe_runs.py)."""
    import ray

    if not ray.is_initialized():
        with workers_import_from(worker_modules):
            start_local_ray(num_cpus=16, address="local", log_to_driver=True)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def gsm8k_local(tmp_path_factory, worker_id, ray_cluster) -> dict:
    """The tiny GSM8K inputs (tests/gsm8k_tiny.py), made once per pytest run (made_once); the recipe
    runs of the tests that use them go in process on this worker's Ray cluster (tests/recipe_runs.py).
    Tests may add their own reward modules to its `root`, each under a name of its own."""
    root = run_shared_dir(tmp_path_factory, worker_id) / "gsm8k_local"
    made_once(root, make_gsm8k_inputs)
    return gsm8k_inputs(root)


@pytest.fixture(scope="session")
def quickstart_working_tree(tmp_path_factory):
    """A directory laid out as `make quickstart` leaves the working tree (tests/working_tree.py)."""
    return build_quickstart_working_tree(tmp_path_factory.mktemp("quickstart_working_tree"))


@pytest.fixture
def in_quickstart_working_tree(quickstart_working_tree, monkeypatch):
    """Runs the test in that directory: the shipped recipes' relative paths (outputs/..., data/...,
    models/...) exist, as after `make quickstart`, whatever the repository's own working tree holds."""
    monkeypatch.chdir(quickstart_working_tree)
    return quickstart_working_tree


@pytest.fixture(scope="module")
def module_in_quickstart_working_tree(quickstart_working_tree):
    """in_quickstart_working_tree for a whole test module: what a module-scoped fixture that reads a
    shipped recipe needs (the working directory comes back after the module)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(quickstart_working_tree)
        yield quickstart_working_tree


@pytest.fixture(scope="session")
def quickstart_warm_start(tmp_path_factory, worker_id):
    """The quickstart's stage 1, run once per pytest run whichever worker asks first (the others
    wait on a file lock and reuse it): the tiny model and arithmetic data of scripts/quickstart.sh,
    then recipes/quickstart_sft.yaml through scripts/run_recipe.sh (400 steps, ~2 min on 2 idle
    cores), without its validation passes. Returns the paths of the data (train / test parquet)
    and of the SFT export (`hf`) an RL stage starts from."""
    root = run_shared_dir(tmp_path_factory, worker_id) / "quickstart_warm_start"
    made_once(root, make_warm_start)
    return {
        "train": root / "data" / "train.parquet",
        "test": root / "data" / "test.parquet",
        "hf": root / "sft" / "hf",
    }


TEACHER_SFT_STEPS = 300


@pytest.fixture(scope="session")
def quickstart_teacher(quickstart_warm_start, tmp_path_factory, worker_id):
    """A distillation teacher made by the quickstart's own pipeline, once per pytest run like the
    warm start: recipes/quickstart_sft.yaml continued from the warm start for TEACHER_SFT_STEPS more
    steps (the warm start stops early on purpose, at ~37%; measured 2026-11-26: 72.5% after 100
    more steps, 80.5% after 200, 82.5% after 300). Returns its export (`hf`) and its held-out
    accuracy after the last step (`accuracy`)."""
    root = run_shared_dir(tmp_path_factory, worker_id) / "quickstart_teacher"
    made_once(root, lambda out: make_teacher(quickstart_warm_start, out))
    accuracy = [r["val/accuracy"] for r in read_metrics(root / "metrics.jsonl") if "val/accuracy" in r]
    return {"hf": root / "hf", "accuracy": accuracy[-1]}


def make_teacher(warm_start: dict, root: Path) -> None:
    overrides = [
        *warm_start_overrides(warm_start, root),
        f"trainer.total_training_steps={TEACHER_SFT_STEPS}",
        f"trainer.test_freq={TEACHER_SFT_STEPS}",  # the teacher's accuracy, at its last step only
        "trainer.logger=[console]",
    ]
    done = run_recipe_script("recipes/quickstart_sft.yaml", overrides, timeout=RUN_TIMEOUT_S)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def make_warm_start(root: Path) -> None:
    """The tiny model, the arithmetic data (<root>/data/{train,test}.parquet) and the SFT run
    (<root>/sft/hf)."""
    data = write_arith_parquet(root / "data")
    run_sft_warm_start("recipes/quickstart_sft.yaml", make_tiny_model(root / "tiny_model"), data, root)
