"""The GSM8K recipes run end to end for 2 steps on CPU: the real recipe files with overrides
pointing at a tiny local model, the hf rollout (vLLM's CPU build in the LoRA run), real GSM8K rows
and a digit-share reward (tests/gsm8k_tiny.py), in this test process on the pytest worker's shared
Ray cluster (tests/recipe_runs.py); the refused recipe's exit status and `error:` line go through
`scripts/run_recipe.sh` itself."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import yaml
from gsm8k_tiny import cpu_overrides
from process_group import run_recipe_script
from recipe_runs import run_recipe_in_process
from safetensors.torch import load_file
from torch.distributed.checkpoint import FileSystemReader
from transformers import AutoModelForCausalLM

from hybridflow.utils.tiny_model import make_tiny_model

ROOT = Path(__file__).resolve().parents[1]
STEP_KEYS = (
    "reward/mean",
    "response_length/mean",
    "actor/pg_loss",
    "actor/pg_clipfrac",
    "actor/ppo_kl",
    "actor/entropy",
    "actor/grad_norm",
    "throughput/tokens_per_s",
    "timing/weight_sync",
    "timing/gen",
    "timing/reward",
    "timing/old_log_prob",
    "timing/adv",
    "timing/update_actor",
    "timing/step",
)


def check_run(out: Path, extra_keys: tuple[str, ...]) -> list[dict]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["step"] in (1, 2) and "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for record in steps:
        missing = [k for k in (*STEP_KEYS, *extra_keys) if k not in record]
        assert not missing, f"step {record['step']} lacks {missing}"
        assert 0.0 <= record["reward/mean"] <= 1.0
        assert 1 <= record["response_length/mean"] <= 16
        assert record["actor/grad_norm"] > 0
    # the reference is the initial policy: equal at step 1 (sampled before any update), apart after it
    assert steps[0]["kl/mean"] == pytest.approx(0.0, abs=1e-5)
    assert abs(steps[1]["kl/mean"]) > 1e-4
    assert "val/accuracy" in steps[-1] and "val/openai/gsm8k/accuracy" in steps[-1]
    assert yaml.safe_load((out / "config.yaml").read_text())["trainer"]["total_training_steps"] == 2
    assert (out / "checkpoints" / "latest").read_text().strip() == "global_step_2"
    return steps


@pytest.mark.slow
def test_grpo_lora_recipe_runs_two_steps_with_tensor_parallel_2_and_vllm_adapter_sync(gsm8k_local, tmp_path):
    """The real vLLM engine (CPU build) in each of the two Ray workers, fed by the TP-2 actor's
    LoRA adapters alone (actor.lora.sync=adapters), each sync checked against the actor's
    log-probs (rollout.verify_weight_sync); the engine's top-4 against the TP-2 actor's
    vocabulary-parallel view of them (rollout.top_k_log_probs)."""
    overrides = [
        *cpu_overrides(gsm8k_local, tmp_path / "grpo", tp=2),
        "rollout.name=vllm",
        "actor.lora.sync=adapters",
        "rollout.verify_weight_sync=true",
        "rollout.top_k_log_probs=4",
        "rollout.sampling.n=2",
        "actor.update.ppo_mini_batch_size=4",
        "trainer.export_hf=true",
    ]
    result = run_recipe_in_process("recipes/gsm8k_grpo_lora.yaml", overrides, pythonpath=gsm8k_local["root"])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    steps = check_run(
        tmp_path / "grpo", extra_keys=("kl/mean", "actor/kl_loss", "timing/ref", "actor/trainable_params")
    )
    # fp32 engine and actor on the same weights: the same distributions up to kernels
    assert all(r["mismatch/top1_agreement"] > 0.9 and r["mismatch/top_k_kl_max"] < 1e-3 for r in steps), steps
    # the exported actor (adapters merged, gathered from its two tensor-parallel shards) moved
    # where the adapters are and nowhere else
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "grpo" / "hf")
    initial = AutoModelForCausalLM.from_pretrained(gsm8k_local["model"])
    for (name, param), (_, start) in zip(
        exported.named_parameters(), initial.named_parameters(), strict=True
    ):
        assert param.shape == start.shape, name
    assert torch.equal(exported.model.embed_tokens.weight, initial.model.embed_tokens.weight)
    layer, start = exported.model.layers[0], initial.model.layers[0]
    assert not torch.equal(layer.self_attn.q_proj.weight, start.self_attn.q_proj.weight)


@pytest.mark.slow
def test_ppo_recipe_runs_two_steps_with_a_critic(gsm8k_local, tmp_path):
    overrides = [
        *cpu_overrides(gsm8k_local, tmp_path / "ppo", tp=1),
        "actor.update.ppo_mini_batch_size=4",
        "critic.megatron.tensor_model_parallel_size=1",
        "critic.megatron.params_dtype=float32",
        "critic.update.ppo_mini_batch_size=2",
        "critic.update.ppo_micro_batch_size=1",
    ]
    result = run_recipe_in_process("recipes/gsm8k_ppo.yaml", overrides, pythonpath=gsm8k_local["root"])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    own_seconds = ("timing/update_actor_worker", "timing/update_critic_worker")
    steps = check_run(
        tmp_path / "ppo",
        extra_keys=("critic/vf_loss", "kl/mean", "timing/values", "timing/update_critic", *own_seconds),
    )
    assert all("critic/values_mean" in r for r in steps)
    # each update's own time in its worker, below the driver's time for both
    assert all(0 < r[key] < r["timing/update"] for r in steps for key in own_seconds), steps


@pytest.mark.slow
def test_remax_with_a_reward_model_on_one_process_then_resume(gsm8k_local, tmp_path):
    """ReMax's greedy baseline in the loop, scored (like the samples) by a learned reward model;
    a second launch with a higher step budget resumes from the step-1 checkpoint."""
    overrides = [
        *cpu_overrides(gsm8k_local, tmp_path / "remax", tp=1),
        "algorithm.adv_estimator=remax",
        "reward_model.enable=true",
        f"reward_model.path={gsm8k_local['model']}",
        "reward_model.megatron.params_dtype=float32",
        "reward_model.micro_batch_size=2",
        "reward_model.use_dynamic_bsz=true",  # packed scoring (the actor packs too: the recipe's default)
        "actor.update.use_kl_loss=false",
        "rollout.sampling.n=2",
        "actor.update.ppo_mini_batch_size=8",
        "trainer.n_gpus_per_node=1",
        "trainer.total_training_steps=1",
        "trainer.val_before_train=false",
        "trainer.test_freq=0",
        "trainer.save_freq=1",
        "reward.custom_fn=digit_reward.seven",
    ]
    result = run_recipe_in_process("recipes/gsm8k_grpo.yaml", overrides, pythonpath=gsm8k_local["root"])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    metrics_file = tmp_path / "remax" / "metrics.jsonl"
    (record,) = [json.loads(line) for line in metrics_file.read_text().splitlines()]
    assert "timing/gen_baseline" in record and "timing/ref" not in record and "kl/mean" not in record
    assert record["actor/grad_norm"] > 0
    # the scores are the reward model's values, not the rule (which would give 7.0 everywhere)
    assert record["reward/max"] != 7.0 and record["reward/min"] != 7.0

    more_steps = [*overrides, "trainer.total_training_steps=2"]
    result = run_recipe_in_process("recipes/gsm8k_grpo.yaml", more_steps, pythonpath=gsm8k_local["root"])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    first, second = [json.loads(line) for line in metrics_file.read_text().splitlines()]
    assert first == record and second["step"] == 2  # step 1 kept, not rerun
    checkpoints = tmp_path / "remax" / "checkpoints"
    assert (checkpoints / "latest").read_text().strip() == "global_step_2"
    assert (checkpoints / "global_step_1" / "rollout" / "rank_0.pt").is_file()


@pytest.mark.slow
def test_dapo_recipe_runs_two_steps_with_dynamic_sampling_and_overlong_shaping(gsm8k_local, tmp_path):
    """The DAPO recipe on the quickstart-sized model: groups whose two responses got the same digit
    share are dropped and refilled from more prompts; responses reaching the 16-token limit lose up
    to 1 through the 4-token overlong zone."""
    overrides = [
        *cpu_overrides(gsm8k_local, tmp_path / "dapo", tp=1),
        "rollout.sampling.n=2",
        "actor.update.ppo_mini_batch_size=4",
        "algorithm.filter_groups.max_num_gen_batches=8",
        "algorithm.overlong_buffer.length=4",
    ]
    result = run_recipe_in_process("recipes/gsm8k_dapo.yaml", overrides, pythonpath=gsm8k_local["root"])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    out = tmp_path / "dapo"
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    sampling_keys = (
        "dynamic_sampling/gen_batches",
        "dynamic_sampling/dropped_groups",
        "dynamic_sampling/dropped_group_share",
    )
    for record in steps:
        missing = [k for k in (*STEP_KEYS, *sampling_keys) if k not in record]
        assert not missing, f"step {record['step']} lacks {missing}"
        assert record["actor/grad_norm"] > 0 and "kl/mean" not in record  # DAPO has no KL term
        # each round generates 4 groups; the dropped ones are counted, and at least 4 were kept
        generated = 4 * record["dynamic_sampling/gen_batches"]
        dropped = record["dynamic_sampling/dropped_groups"]
        assert record["dynamic_sampling/dropped_group_share"] == pytest.approx(dropped / generated)
        assert generated - dropped >= 4
        # digit share in [0, 1] plus a penalty in [-1, 0]; a random model rarely stops before 16 tokens
        assert -1.0 <= record["reward/min"] < 0.0 and record["reward/max"] <= 1.0
    assert "val/accuracy" in steps[-1]
    assert (out / "checkpoints" / "latest").read_text().strip() == "global_step_2"


@pytest.mark.slow
def test_distill_recipe_runs_two_steps_with_a_tp1_teacher_pool_beside_a_tp2_student(gsm8k_local, tmp_path):
    """recipes/gsm8k_distill.yaml with a tiny Llama teacher (another model, the same tokenizer) on
    a pool of its own at TP 1 and the Qwen2 student at TP 2 (3 CPU processes), packed
    micro-batches (the recipe's use_dynamic_bsz) for both, and a LoRA student (the signal trains its
    adapters, the base stays frozen). The other way round, teacher TP 2 and a full-weight student at
    TP 1, is tests/test_resume.py's distillation case."""
    teacher = make_tiny_model(tmp_path / "teacher", arch="llama", num_layers=2, seed=7, init_std=0.1)
    overrides = [
        *cpu_overrides(gsm8k_local, tmp_path / "distill", tp=2),
        f"teacher.path={teacher}",
        "teacher.n_gpus_per_node=1",
        "teacher.megatron.tensor_model_parallel_size=1",
        "teacher.megatron.params_dtype=float32",
        "teacher.log_prob_micro_batch_size=2",
        "trainer.n_gpus_per_node=3",  # 2 for the student, 1 for the teacher
        "actor.lora.rank=8",  # a LoRA student: the reverse KL trains its adapters only
        "rollout.sampling.n=2",
        "actor.update.ppo_mini_batch_size=8",
    ]
    result = run_recipe_in_process("recipes/gsm8k_distill.yaml", overrides, pythonpath=gsm8k_local["root"])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    records = [json.loads(line) for line in (tmp_path / "distill" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for record in steps:
        missing = [k for k in (*STEP_KEYS, *DISTILL_KEYS, "timing/teacher") if k not in record]
        assert not missing, f"step {record['step']} lacks {missing}"
        assert record["actor/grad_norm"] > 0 and "kl/mean" not in record  # no reference model
        # pure distillation: each token's advantage is minus its reverse-KL estimate
        assert record["advantages/mean"] == pytest.approx(-record["distill/reverse_kl"], rel=1e-5, abs=1e-7)
        # two different random models: the teacher's numbers are its own, not the student's
        assert record["distill/teacher_log_prob"] != pytest.approx(
            record["distill/student_log_prob"], abs=1e-3
        )
        assert 0.0 < record["distill/teacher_more_confident"] < 1.0
    assert "val/accuracy" in steps[-1]
    saved = tmp_path / "distill/checkpoints/global_step_2/actor"
    trained = actor_checkpoint_tensors(saved, "lora_B")
    assert trained and all(tensor.abs().max() > 0 for tensor in trained.values())  # B starts at zero
    embedding = actor_checkpoint_tensors(
        tmp_path / "distill/checkpoints/global_step_2/actor", "word_embeddings"
    )
    student = load_file(Path(gsm8k_local["model"]) / "model.safetensors")["model.embed_tokens.weight"]
    assert torch.equal(next(iter(embedding.values()))[: len(student)], student)  # the base stays frozen


def actor_checkpoint_tensors(path: Path, part: str) -> dict[str, torch.Tensor]:
    """The model tensors (not the optimizer's) of a saved actor whose names contain `part`, whole."""
    reader = FileSystemReader(path)
    shapes = reader.read_metadata().state_dict_metadata
    names = [name for name in shapes if part in name and not name.startswith("optimizer.")]
    state = {name: torch.empty(shapes[name].size, dtype=shapes[name].properties.dtype) for name in names}
    dcp.load(state, storage_reader=reader, no_dist=True)  # this process only: no process group
    return state


DISTILL_KEYS = (
    "distill/reverse_kl",
    "distill/student_log_prob",
    "distill/teacher_log_prob",
    "distill/teacher_more_confident",
)


@pytest.mark.usefixtures("in_quickstart_working_tree")
@pytest.mark.parametrize("recipe", ["recipes/gsm8k_dapo.yaml", "recipes/gsm8k_gspo.yaml"])
def test_dapo_and_gspo_recipes_validate_with_their_algorithm_settings(gsm8k_local, tmp_path, recipe):
    from hybridflow.checks.recipe import validate_recipe
    from hybridflow.config.loader import load_recipe

    tiny = ["rollout.sampling.n=2", "actor.update.ppo_mini_batch_size=4", "reward.custom_fn=null"]
    if "dapo" in recipe:
        tiny.append("algorithm.overlong_buffer.length=4")  # within the 16-token responses
    cfg = load_recipe(ROOT / recipe, [*cpu_overrides(gsm8k_local, tmp_path, tp=1), *tiny])
    validate_recipe(cfg, cuda_available=False)
    if "gspo" in recipe:
        update = cfg.actor.update
        assert (update.policy_loss, update.clip_ratio_low, update.clip_ratio_high) == ("gspo", 3e-4, 4e-4)
    else:
        assert cfg.algorithm.filter_groups.enable and cfg.algorithm.overlong_buffer.enable
        assert cfg.actor.update.clip_ratio_high > cfg.actor.update.clip_ratio_low


def test_invalid_recipe_exits_non_zero_with_the_error(tmp_path):
    result = run_recipe_script(
        "recipes/gsm8k_grpo.yaml",
        ["trainer.use_gpu=false", "rollout.name=hf", "rollout.tensor_model_parallel_size=1"],
        timeout=600,
    )
    assert result.returncode == 2
    # the recipe's local directory is absent, and as a Hub id it is not cached (tests run offline)
    assert (
        "model.path=models/Qwen2.5-0.5B-Instruct is neither a local directory nor a usable Hub id"
        in result.stderr
    )
    assert "hf download <id> --local-dir <dir>" in result.stderr
    help_text = subprocess.run(
        [sys.executable, "-m", "hybridflow.trainer.main", "--help"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=True,
    ).stdout
    assert "key.path=value" in help_text


@pytest.mark.slow
def test_qwen3_moe_grpo_recipe_runs_two_steps_with_expert_parallel_2(gsm8k_local, tmp_path):
    """A tiny Qwen3-MoE (4 experts, top-2) on 2 CPU processes, experts split EP 2 (TP 1, DP 2):
    the router's load-balancing loss is in the actor's loss and logged, and the trained actor
    exports per expert in a form transformers loads."""
    moe_model = make_tiny_model(tmp_path / "tiny_moe", arch="qwen3_moe", num_experts=4, num_layers=2)
    overrides = [
        *cpu_overrides({**gsm8k_local, "model": str(moe_model)}, tmp_path / "moe", tp=1),
        "actor.megatron.expert_model_parallel_size=2",
        "actor.megatron.param_offload=false",
        "actor.megatron.grad_offload=false",
        "actor.megatron.optimizer_offload=false",
        "rollout.sampling.n=2",
        "actor.update.ppo_mini_batch_size=4",
        "trainer.export_hf=true",
    ]
    result = run_recipe_in_process("recipes/qwen3_moe_grpo.yaml", overrides, pythonpath=gsm8k_local["root"])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    steps = check_run(tmp_path / "moe", extra_keys=("actor/moe_aux_loss", "kl/mean", "actor/kl_loss"))
    # Switch-Transformer loss: E * sum_i f_i P_i, 1 when perfectly balanced, at most E = 4
    assert all(0.5 < r["actor/moe_aux_loss"] < 4.0 for r in steps)
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "moe" / "hf")
    initial = AutoModelForCausalLM.from_pretrained(moe_model)
    assert not torch.equal(
        exported.model.layers[0].mlp.experts.down_proj, initial.model.layers[0].mlp.experts.down_proj
    )
