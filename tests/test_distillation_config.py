"""The recipe side of on-policy distillation, before any worker: the GSM8K recipe validates on 8
devices, the teacher's layout (in the actor's processes or on a pool of its own) gives its
data-parallel size and its place among the worker pools, and the rules between the teacher and
algorithm.distillation name the keys. The refusals through the entry point are rows of
docs/bad-inputs.md."""

from pathlib import Path

import pytest

from hybridflow.checks.recipe import RecipeError, validate_recipe
from hybridflow.config.loader import load_recipe
from hybridflow.trainer.roles import resource_pool_manager, role_classes
from hybridflow.utils.tiny_model import make_tiny_model

ROOT = Path(__file__).resolve().parents[1]
GSM8K = ROOT / "recipes/gsm8k_distill.yaml"
QUICKSTART = ROOT / "recipes/quickstart_distill.yaml"


@pytest.fixture(scope="module")
def local(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("distill_config")
    for name in ("train", "test"):
        (root / f"{name}.parquet").write_bytes(b"")
    return {
        "student": make_tiny_model(root / "student"),
        "teacher": make_tiny_model(root / "teacher", arch="llama", num_layers=2),
        "train": root / "train.parquet",
        "test": root / "test.parquet",
    }


def gsm8k(local: dict, *overrides: str):
    """The GSM8K recipe on the tiny models and an hf rollout (no sglang here)."""
    paths = [
        f"model.path={local['student']}",
        f"teacher.path={local['teacher']}",
        f"data.train_files=[{local['train']}]",
        f"data.val_files=[{local['test']}]",
        "data.max_prompt_length=256",  # prompt + response fit the tiny models' 512 positions
        "rollout.response_length=256",
        "rollout.name=hf",
        "rollout.tensor_model_parallel_size=1",
    ]
    return load_recipe(GSM8K, [*paths, *overrides])


def test_the_gsm8k_recipe_names_a_hub_teacher_and_validates_on_eight_devices(local):
    shipped = load_recipe(GSM8K)
    assert shipped.teacher.path == "Qwen/Qwen2.5-7B-Instruct" and shipped.algorithm.distillation.enable
    assert shipped.model.path == "Qwen/Qwen2.5-0.5B-Instruct"
    layout = validate_recipe(gsm8k(local), cuda_available=True)
    assert (layout.actor_devices, layout.actor_dp, layout.teacher_dp) == (
        8,
        4,
        4,
    )  # colocated: the actor's DP
    assert "teacher" in role_classes(gsm8k(local))["global_pool"]


def test_a_teacher_pool_of_its_own_takes_its_devices_from_the_node(local):
    cfg = gsm8k(local, "teacher.n_gpus_per_node=4", "teacher.megatron.tensor_model_parallel_size=4")
    layout = validate_recipe(cfg, cuda_available=True)
    assert (layout.actor_devices, layout.actor_dp, layout.teacher_dp) == (4, 2, 1)
    pools = role_classes(cfg)
    assert list(pools["teacher_pool"]) == ["teacher"] and "teacher" not in pools["global_pool"]
    spec = resource_pool_manager(cfg).resource_pool_spec
    assert spec == {"global_pool": [4], "teacher_pool": [4]}


def test_no_teacher_without_distillation(local):
    cfg = gsm8k(local, "algorithm.distillation.enable=false", "teacher.path=null")
    assert validate_recipe(cfg, cuda_available=True).teacher_dp == 0
    assert all("teacher" not in roles for roles in role_classes(cfg).values())


def test_the_teacher_rules_name_their_keys(local):
    with pytest.raises(RecipeError) as err:
        validate_recipe(
            gsm8k(local, "teacher.n_gpus_per_node=-1", "algorithm.distillation.task_coef=-1"), True
        )
    assert "teacher.n_gpus_per_node must be >= 0 (0: in the actor's processes), got -1" in str(err.value)
    assert "algorithm.distillation.task_coef must be >= 0 (0: pure distillation), got -1.0" in str(err.value)
    with pytest.raises(RecipeError) as err:  # its own pool: 7 devices over TP 2
        validate_recipe(gsm8k(local, "teacher.n_gpus_per_node=1"), True)
    assert "teacher.megatron: TP × PP × CP = 2×1×1 = 2 does not divide the 1 devices" in str(err.value)


@pytest.mark.usefixtures("in_quickstart_working_tree")  # the quickstart's outputs exist there
def test_the_quickstart_recipe_distils_the_grpo_export_into_the_sft_warm_start():
    cfg = load_recipe(QUICKSTART)
    assert validate_recipe(cfg, cuda_available=False).teacher_dp == 1
    assert (cfg.model.path, cfg.teacher.path) == ("outputs/quickstart/sft/hf", "outputs/quickstart/grpo/hf")
    assert cfg.algorithm.distillation.enable and cfg.algorithm.distillation.task_coef == 0.0
    assert cfg.teacher.megatron.tensor_model_parallel_size == cfg.actor.megatron.tensor_model_parallel_size


def test_a_lora_student_generating_ahead_on_a_rollout_pool_keeps_the_teacher_beside_the_policy(local):
    cfg = gsm8k(
        local,
        "actor.lora.rank=8",
        "trainer.placement=disaggregated",
        "trainer.rollout_pool.n_gpus_per_node=2",
        "trainer.async_training.mode=one_step",
    )
    assert validate_recipe(cfg, cuda_available=True).teacher_dp == 4
    pools = role_classes(cfg)
    assert list(pools["global_pool"]) == ["policy", "teacher"] and list(pools["rollout_pool"]) == ["rollout"]
