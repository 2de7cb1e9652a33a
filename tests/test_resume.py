"""Kill and resume: a run killed with SIGKILL after its first checkpoint, restarted with the same
command, says it resumed (`resumed from <checkpoint> at step N`), keeps the killed run's metrics
rows up to N byte for byte (wall-clock timings included, so a rerun from scratch would not reproduce
them), continues the step numbering, and ends with the same metrics (bit for bit), the same samples
trained on (trainer.save_samples: the killed run's files up to N kept) and the same exported weights
as a run that was never interrupted. Once for PPO with a critic and an adaptive KL controller (KL in
the reward, so a reference policy too), once for GRPO with LoRA adapters and a KL loss (the
reference is the actor with its adapters off), once for on-policy distillation with a TP-2 teacher
on a pool of its own beside a TP-1 student, once for GRPO on a tiny Qwen3-MoE with routing replay
(R3: the actor's routers use the experts the engine recorded).

What has to come back for that: actor weights, Adam state and LR schedule (Megatron dist
checkpoint), the worker and rollout sampling RNG, the driver RNG, the dataloader position, the
global step, the critic's weights and Adam state, the KL coefficient; under LoRA the adapters and
their Adam state (sharded like their base weights). On CPU with one thread per
process every computation repeats exactly, so the comparison is exact; the timing and throughput
metrics are wall-clock and are left out.

The tiny random model never answers arithmetic, so the reward is the share of digits in the
response (a custom reward loaded by dotted path): advantages and updates are then nonzero from
the first step, and a lost optimizer state or a replayed batch would change the numbers.
"""

import json
import os
from pathlib import Path

import pytest
import torch
from hf_weights import load_hf_tensors
from process_group import run_and_kill_at_step, run_in_own_session
from recipe_runs import run_recipe_in_process
from run_outputs import without_uids
from transformers import AutoModelForCausalLM, AutoTokenizer

from hybridflow.data.arith import ArithConfig, write_arith_parquet
from hybridflow.trainer.samples import read_samples
from hybridflow.utils.tiny_model import make_tiny_model
from hybridflow.utils.tracking import read_metrics

ROOT = Path(__file__).resolve().parents[1]
RECIPE = "recipes/quickstart.yaml"
TOTAL_STEPS = 6
KILL_AFTER_STEP = 3  # > the first checkpoint (save_freq 2)
WALL_CLOCK_PREFIXES = ("timing/", "throughput/")

DIGIT_REWARD = """
def digit_share(data_source, solution_str, ground_truth, extra_info):
    return sum(c.isdigit() for c in solution_str) / max(len(solution_str), 1)
"""


@pytest.fixture(scope="module")
def local(tmp_path_factory, ray_cluster) -> dict:
    root = tmp_path_factory.mktemp("resume")
    (root / "resume_reward.py").write_text(DIGIT_REWARD)
    data = write_arith_parquet(root / "data", ArithConfig(num_train=64, num_test=8, seed=5))
    teacher = make_tiny_model(root / "teacher", arch="llama", num_layers=2, seed=7, init_std=0.1)
    return {
        "root": root,
        "model": make_tiny_model(root / "tiny", num_layers=2),
        "data": data,
        "teacher": teacher,
        "moe": make_tiny_model(root / "tiny_moe", arch="qwen3_moe", num_layers=2, num_experts=4),
    }


# (plain GRPO's resume is the LoRA case without adapters: the PPO case covers full weights)
ALGORITHMS = {
    "ppo_critic_adaptive_kl": [
        "algorithm.adv_estimator=gae",
        "critic.enable=true",
        "critic.update.ppo_mini_batch_size=8",
        "critic.update.ppo_micro_batch_size=4",
        "algorithm.use_kl_in_reward=true",
        "algorithm.kl_ctrl.type=adaptive",
        "algorithm.kl_ctrl.kl_coef=0.05",
        "algorithm.kl_ctrl.target_kl=0.01",
        "algorithm.kl_ctrl.horizon=10",
    ],
    # LoRA adapters and their Adam state; the KL loss's reference is the actor with adapters off
    "grpo_lora_kl_loss": [
        "actor.lora.rank=8",
        "actor.lora.alpha=16",
        "actor.optim.lr=2e-3",
        "actor.update.use_kl_loss=true",
        "actor.update.kl_loss_coef=0.1",
    ],
    # on-policy distillation mixed with the task reward: a tiny Llama teacher on a pool of its own
    # at TP 2, the student at TP 1 on one process (3 processes); the teacher is frozen, so nothing
    # of it is saved, and its scores must come out the same after the resume
    "distill_teacher_tp2_student_tp1": [
        "algorithm.distillation.enable=true",
        "algorithm.distillation.task_coef=0.5",
        "teacher.path={teacher}",
        "teacher.n_gpus_per_node=2",
        "teacher.megatron.tensor_model_parallel_size=2",
        "actor.megatron.tensor_model_parallel_size=1",
        "trainer.n_gpus_per_node=3",
    ],
    # R3 (docs/routing-replay.md) on the tiny Qwen3-MoE (2 layers, 4 experts, top-2), TP 1 (DP 2):
    # the routes are not saved but recorded anew by each step's rollout, so they replay the same
    # after the resume only if the sampling RNG and weights came back exactly; `stop` ends the run
    # if the engine's and the actor's log-probs ever part
    "grpo_moe_routing_replay": [
        "model.path={moe}",  # after the dense model.path above: the later override wins
        "actor.megatron.tensor_model_parallel_size=1",
        "rollout.return_routed_experts=true",
        "actor.megatron.moe_routing_replay=rollout",
        "trainer.mismatch_policy=stop",
    ],
}


def command(local: dict, output_dir: Path, algorithm: str) -> list[str]:
    """`scripts/run_recipe.sh` with the recipe and its overrides."""
    return [
        "bash",
        str(ROOT / "scripts/run_recipe.sh"),
        str(ROOT / RECIPE),
        *overrides(local, output_dir, algorithm),
    ]


def overrides(local: dict, output_dir: Path, algorithm: str) -> list[str]:
    """The quickstart recipe made tiny: TP 2 over 2 processes, 4 prompts x 4 samples, 6 steps,
    a checkpoint every 2 steps, validation every 3, HF export at the end."""
    return [
        f"model.path={local['model']}",
        f"data.train_files=[{local['data']['train']}]",
        f"data.val_files=[{local['data']['test']}]",
        "data.train_batch_size=4",
        "reward.custom_fn=resume_reward.digit_share",
        "rollout.sampling.n=4",
        "rollout.response_length=12",
        "actor.optim.lr=1e-3",
        "actor.update.ppo_mini_batch_size=8",  # two optimizer steps per RL step
        "actor.update.ppo_micro_batch_size=4",
        "actor.log_prob_micro_batch_size=8",
        f"trainer.total_training_steps={TOTAL_STEPS}",
        "trainer.save_freq=2",
        "trainer.max_ckpt_to_keep=null",
        "trainer.test_freq=3",
        "trainer.val_before_train=false",
        "trainer.logger=[console]",
        "trainer.save_samples=true",
        f"trainer.output_dir={output_dir}",
        *(override.format(teacher=local["teacher"], moe=local["moe"]) for override in ALGORITHMS[algorithm]),
    ]


def environment(local: dict) -> dict:
    return {
        **os.environ,
        "RAY_ADDRESS": "local",  # a fresh Ray instance per run, never another test's cluster
        "OMP_NUM_THREADS": "1",
        "PYTHONWARNINGS": "ignore",
        "PYTHONPATH": str(local["root"]),
    }


def run_to_end(local: dict, output_dir: Path, algorithm: str) -> str:
    """Runs to the end with `scripts/run_recipe.sh`; returns stdout."""
    result = run_in_own_session(command(local, output_dir, algorithm), env=environment(local), timeout=1200)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


def run_uninterrupted(local: dict, output_dir: Path, algorithm: str) -> None:
    """The reference: the same run, never killed, in this process on the pytest worker's Ray cluster
    (what it is compared on does not depend on the process it ran in)."""
    result = run_recipe_in_process(RECIPE, overrides(local, output_dir, algorithm), pythonpath=local["root"])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


def run_and_kill_after(local: dict, output_dir: Path, step: int, algorithm: str) -> None:
    log = output_dir.parent / f"{output_dir.name}.log"
    cmd = command(local, output_dir, algorithm)
    run_and_kill_at_step(cmd, environment(local), output_dir / "metrics.jsonl", step, log)


def comparable(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(WALL_CLOCK_PREFIXES)} for r in records]


def rows_up_to(path: Path, step: int) -> list[bytes]:
    return [line for line in path.read_bytes().splitlines(keepends=True) if json.loads(line)["step"] <= step]


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", list(ALGORITHMS))
def test_killed_run_resumes_to_the_same_metrics_and_weights(local, tmp_path, algorithm):
    reference_dir, resumed_dir = tmp_path / "reference", tmp_path / "resumed"
    run_and_kill_after(local, resumed_dir, KILL_AFTER_STEP, algorithm)
    killed_latest = (resumed_dir / "checkpoints" / "latest").read_text().strip()
    assert killed_latest in ("global_step_2", "global_step_4")
    assert not (resumed_dir / "hf").exists()
    resume_step = int(killed_latest.removeprefix("global_step_"))
    killed_rows = rows_up_to(resumed_dir / "metrics.jsonl", resume_step)
    assert [json.loads(r)["step"] for r in killed_rows] == list(range(1, resume_step + 1))
    killed_samples = read_samples(resumed_dir)[:resume_step]

    out = run_to_end(local, resumed_dir, algorithm)  # the same command again: resume_mode auto
    run_uninterrupted(local, reference_dir, algorithm)

    checkpoint = resumed_dir / "checkpoints" / killed_latest
    assert f"resumed from {checkpoint} at step {resume_step}" in out
    # the killed run's rows up to the checkpoint, timings included, are the same bytes: kept, not redone
    assert rows_up_to(resumed_dir / "metrics.jsonl", resume_step) == killed_rows
    reference = read_metrics(reference_dir / "metrics.jsonl")
    resumed = read_metrics(resumed_dir / "metrics.jsonl")
    assert [r["step"] for r in resumed] == list(range(1, TOTAL_STEPS + 1))  # no step logged twice
    assert comparable(resumed) == comparable(reference)
    # what each step trained on (trainer.save_samples): the killed run's steps up to the checkpoint
    # kept, the later ones written again, and all the same as the uninterrupted run's
    samples = read_samples(resumed_dir)
    assert samples[:resume_step] == killed_samples and len(samples) == TOTAL_STEPS
    assert [without_uids(step) for step in samples] == [
        without_uids(step) for step in read_samples(reference_dir)
    ]
    assert reference[0]["actor/grad_norm"] > 0 and "val/accuracy" in reference[2]
    assert len({r["reward/mean"] for r in reference}) > 1  # the runs did learn something
    if algorithm == "ppo_critic_adaptive_kl":  # the critic trained and the adaptive coefficient moved
        assert reference[0]["critic/grad_norm"] > 0
        assert len({r["kl/reward_coef"] for r in reference}) == TOTAL_STEPS
    if "distill" in algorithm:  # the teacher scored every step (a frozen model of its own)
        assert all(r["distill/teacher_more_confident"] > 0 for r in reference)
        assert "timing/teacher" in reference[0]

    moe = "moe" in algorithm
    exported = load_hf_tensors(resumed_dir / "hf")
    expected = load_hf_tensors(reference_dir / "hf")
    initial = load_hf_tensors(local["moe" if moe else "model"])
    assert exported.keys() == expected.keys() == initial.keys()
    assert all(torch.equal(exported[k], expected[k]) for k in expected)  # bit-for-bit
    lora = "lora" in algorithm  # adapters on the linears only, merged into the export
    moved = "model.layers.0.self_attn.q_proj.weight" if lora else "model.embed_tokens.weight"
    assert not torch.equal(exported[moved], initial[moved])
    if lora:
        assert torch.equal(exported["model.embed_tokens.weight"], initial["model.embed_tokens.weight"])
    if moe:  # replay picks the experts, the router's scores still weigh them: the router trained
        assert not torch.equal(
            exported["model.layers.0.mlp.gate.weight"], initial["model.layers.0.mlp.gate.weight"]
        )
        assert all(r["mismatch/log_prob_abs_diff_max"] < 1e-4 for r in reference)  # fp32 engine and actor
        # the engine sampled with the same fp32 weights: the routers pick the replayed experts themselves
        assert all(r["mismatch/router_agreement"] > 0.99 for r in reference), reference
    generates_with_transformers(resumed_dir / "hf", "Qwen3MoeForCausalLM" if moe else "Qwen2ForCausalLM")


def generates_with_transformers(hf_dir: Path, architecture: str) -> None:
    """The exported final actor (<output_dir>/hf) loads with transformers' Auto classes and
    generates."""
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    model = AutoModelForCausalLM.from_pretrained(hf_dir)
    assert json.loads((hf_dir / "config.json").read_text())["architectures"] == [architecture]
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 12+34?"}], add_generation_prompt=True, tokenize=False
    )
    inputs = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        generated = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    assert inputs["input_ids"].shape[1] < generated.shape[1] <= inputs["input_ids"].shape[1] + 8
