"""scripts/gpu_check.sh: the GPU check's `--cpu` mode runs the same in-process path (LocalWorkerGroup,
Megatron actor, hf rollout, GRPO steps) on the tiny model, with its wheel folder installed beside
the environment, and on the tiny LLaVA with image prompts (`--vlm`); the GPU mode's recipes pass the
recipe checks; the MFU arithmetic."""

import os
import sys
import zipfile
from pathlib import Path

import pytest
from process_group import run_in_own_session

from hybridflow.utils.flops import peak_bf16_flops, train_flops_per_token

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
import gpu_check  # noqa: E402


def probe_wheel(folder: Path) -> Path:
    """A minimal pure-Python wheel (package `gpu_check_probe`), standing in for the carried ones."""
    folder.mkdir()
    wheel = folder / "gpu_check_probe-0.1-py3-none-any.whl"
    info = "gpu_check_probe-0.1.dist-info"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("gpu_check_probe/__init__.py", "CARRIED = True\n")
        archive.writestr(f"{info}/METADATA", "Metadata-Version: 2.1\nName: gpu-check-probe\nVersion: 0.1\n")
        archive.writestr(
            f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        archive.writestr(f"{info}/RECORD", "")
    return folder


def run_check(*args: str, env: dict[str, str]):
    return run_in_own_session(
        ["bash", str(REPO / "scripts" / "gpu_check.sh"), *args],
        env={**os.environ, "PYTHON": sys.executable, **env},
        cwd=REPO,
        timeout=600,
    )


@pytest.mark.slow
def test_cpu_mode_trains_three_steps_in_process_with_carried_wheels(tmp_path):
    site = tmp_path / "site"
    env = {"HYBRIDFLOW_GPU_CHECK_SITE": str(site), "OMP_NUM_THREADS": "1"}
    done = run_check("--cpu", "--wheels", str(probe_wheel(tmp_path / "wheels")), env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert (site / "gpu_check_probe" / "__init__.py").is_file()  # installed beside, not into, the env
    table = done.stdout[done.stdout.index("gpu_check on CPU") :].splitlines()
    assert table[1].split(" | ") == [
        "step", "gen s", "update s", "step s", "tokens", "tokens/s", "update TFLOP/s", "update MFU",
    ]  # fmt: skip
    steps = [line.split(" | ") for line in table[2:5]]
    assert [row[0] for row in steps] == ["1", "2", "3"]
    assert all(float(row[5].replace(",", "")) > 0 and row[7] == "n/a" for row in steps), steps
    assert table[5].startswith("peak memory (RSS, CPU run): ")


@pytest.mark.slow
def test_cpu_vlm_mode_trains_the_tiny_llava_on_image_prompts(tmp_path):
    done = run_check("--cpu", "--vlm", "--steps", "2", env={"OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    table = done.stdout[done.stdout.index("gpu_check on CPU: tiny LLaVA, fp32, 32 sequences") :].splitlines()
    steps = [line.split(" | ") for line in table[2:4]]
    assert [row[0] for row in steps] == ["1", "2"], table
    assert all(float(row[4]) > 32 * 16 for row in steps), steps  # 16 image tokens in every prompt


def test_a_model_without_its_data_is_refused(capsys):
    with pytest.raises(SystemExit):
        gpu_check.main(["--cpu", "--model", "some/checkpoint"])
    assert "--model and --data go together" in capsys.readouterr().err


def test_the_parity_mode_runs_gpu_parity_and_refuses_a_machine_without_cuda():
    """The suite runs the same parity workers on CPU ranks; scripts/gpu_parity.py is for a GPU."""
    done = run_check("--parity", env={"CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 2 and "no CUDA device is visible; the suite runs these workers" in done.stderr


def test_an_empty_wheel_folder_is_refused(tmp_path):
    (tmp_path / "wheels").mkdir()
    done = run_check("--cpu", "--wheels", str(tmp_path / "wheels"), env={})
    assert done.returncode == 2 and f"no .whl files in {tmp_path / 'wheels'}" in done.stderr


def gpu_mode_inputs(tmp_path: Path, task: str) -> tuple[Path, dict]:
    """A random model of the task and a small data file: what the recipe checks read of them."""
    if task == "vlm":
        from hybridflow.data.shapes import ShapesConfig, write_shapes_parquet
        from hybridflow.utils.tiny_vlm import make_tiny_vlm

        data = write_shapes_parquet(tmp_path / "data", ShapesConfig(task="quadrant", num_train=8, num_test=2))
        return make_tiny_vlm(tmp_path / "model"), data
    from hybridflow.utils.tiny_model import make_tiny_model

    data = {"train": tmp_path / "train.parquet"}
    data["train"].write_bytes(b"")
    return make_tiny_model(tmp_path / "model"), data


@pytest.mark.usefixtures("in_quickstart_working_tree")
@pytest.mark.parametrize("task", ["text", "vlm"])
def test_the_gpu_mode_recipes_pass_the_recipe_checks(tmp_path, task):
    from hybridflow.checks.recipe import validate_recipe
    from hybridflow.config.loader import load_recipe

    model, data = gpu_mode_inputs(tmp_path, task)
    overrides = gpu_check.recipe_overrides(model, data, tmp_path / "out", cuda=True, steps=3, task=task)
    cfg = load_recipe(REPO / "recipes" / gpu_check.RECIPES[task], overrides)
    assert (cfg.actor.megatron.params_dtype, cfg.actor.megatron.use_distributed_optimizer) == (
        "bfloat16",
        True,
    )
    assert (cfg.rollout.name, cfg.trainer.use_gpu, cfg.trainer.n_gpus_per_node) == ("hf", True, 1)
    layout = validate_recipe(cfg, cuda_available=True)
    assert layout.actor_dp == 1


def test_training_flops_and_peaks():
    class Config:
        hidden_size, intermediate_size, num_hidden_layers = 4, 8, 2
        num_key_value_heads, head_dim, vocab_size = 1, 2, 10

    # per layer 4 * (4 + 2 * 2) + 4 * 4 + 3 * 4 * 8 = 144; matmul params 2 * 144 + 4 * 10 = 328
    assert train_flops_per_token(Config, seq_len=3) == 6 * 328 + 12 * 2 * 4 * 3
    assert peak_bf16_flops("NVIDIA H100 80GB HBM3") == 989.4e12
    assert peak_bf16_flops("Some Other GPU") is None
