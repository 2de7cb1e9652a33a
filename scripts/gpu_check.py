"""The one-command GPU check (what `scripts/gpu_check.sh` runs once its wheels are installed).

GRPO steps of `recipes/quickstart.yaml` (arithmetic prompts, rule reward) with the Megatron-Core
actor and the `hf` rollout, trained in this process through `LocalWorkerGroup`: no Ray, SGLang or
Transformer Engine is needed. On CUDA: a random Qwen2-0.5B-shaped model (24 layers, hidden 896,
14 query / 2 KV heads, MLP 4864, vocabulary 151936, tied embeddings, built by
`hybridflow.utils.tiny_model`) in bf16 with Megatron-Core's distributed optimizer; `--cpu`: the
tiny model in fp32 on CPU (the CI run of the same code path). Prints per step the generation,
actor-update and step times, tokens/s (prompt + response tokens of the step / step time), the
actor update's achieved TFLOP/s and MFU (`hybridflow.utils.flops`; real tokens only), and the
peak memory (CUDA allocator peak on GPU, peak RSS on CPU). Exits 1 when a step is missing, a
loss or grad norm is not finite, or Ray was imported (the machines this is for have none).

    bash scripts/gpu_check.sh [--cpu] [--wheels DIR] [--steps N]
    python scripts/gpu_check.py [--cpu] [--steps N] [--workdir DIR]
"""

import argparse
import json
import math
import resource
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
QWEN2_05B_SHAPE = dict(
    num_layers=24,
    hidden_size=896,
    num_heads=14,
    num_kv_heads=2,
    intermediate_size=4864,
    vocab_size=151936,
    tie_word_embeddings=True,
    max_position_embeddings=1024,
)
# Per mode: prompts per step (x 8 samples), response length, micro-batch rows (update, log-probs).
SETTINGS = {
    "cuda": dict(prompts=32, response_length=256, micro=16, log_prob_micro=32),
    "cpu": dict(prompts=8, response_length=16, micro=16, log_prob_micro=32),
}
SAMPLES_PER_PROMPT = 8  # the quickstart recipe's rollout.sampling.n


def recipe_overrides(model: Path, data: dict, out: Path, cuda: bool, steps: int) -> list[str]:
    """key=value settings over recipes/quickstart.yaml for a one-process run of `steps` steps."""
    s = SETTINGS["cuda" if cuda else "cpu"]
    rows = s["prompts"] * SAMPLES_PER_PROMPT
    overrides = [
        f"model.path={model}",
        f"data.train_files=[{data['train']}]",
        "data.val_files=[]",
        f"data.train_batch_size={s['prompts']}",
        f"trainer.output_dir={out}",
        f"trainer.total_training_steps={steps}",
        "trainer.n_gpus_per_node=1",
        f"trainer.use_gpu={str(cuda).lower()}",
        "trainer.test_freq=0",
        "trainer.val_before_train=false",
        "trainer.save_freq=0",
        "trainer.export_hf=false",
        "trainer.logger=[console]",
        "actor.megatron.tensor_model_parallel_size=1",
        "critic.megatron.tensor_model_parallel_size=1",
        f"actor.update.ppo_mini_batch_size={rows}",
        f"actor.update.ppo_micro_batch_size={s['micro']}",
        f"actor.log_prob_micro_batch_size={s['log_prob_micro']}",
        f"rollout.response_length={s['response_length']}",
    ]
    if cuda:
        overrides += [
            "actor.megatron.params_dtype=bfloat16",
            "actor.megatron.use_distributed_optimizer=true",
            "rollout.dtype=bfloat16",
        ]
    return overrides


def make_inputs(workdir: Path, cuda: bool) -> tuple[Path, dict]:
    from hybridflow.data.arith import write_arith_parquet
    from hybridflow.utils.tiny_model import make_tiny_model

    shape = QWEN2_05B_SHAPE if cuda else {}
    return make_tiny_model(workdir / "model", **shape), write_arith_parquet(workdir / "data")


def train(overrides: list[str]) -> tuple[dict, list[dict]]:
    """Run the GRPO steps in this process; (the model's HF config, metrics.jsonl rows)."""
    import torch

    from engines.megatron.model import load_hf_config
    from hybridflow.single_controller import LocalWorkerGroup, RayClassWithInitArgs
    from hybridflow.trainer.main import prepare
    from hybridflow.trainer.policy import Policy
    from hybridflow.trainer.ppo_trainer import PPOTrainer
    from hybridflow.trainer.roles import Roles
    from hybridflow.trainer.rollout.colocated import ColocatedRollout
    from hybridflow.workers.hybrid_policy import HybridPolicyWorker

    cfg, layout = prepare([str(REPO / "recipes" / "quickstart.yaml"), *overrides])
    group = LocalWorkerGroup(ray_cls_with_init=RayClassWithInitArgs(HybridPolicyWorker, cfg))
    try:
        group.init_model()
        roles = Roles(Policy(group), ColocatedRollout(group), critic=None, reward_model=None, groups=[group])
        PPOTrainer(cfg, roles, actor_dp=layout.actor_dp).fit(None)
    finally:
        group.shutdown()
        if torch.distributed.is_initialized():  # the in-process rank's group (NCCL warns at exit)
            torch.distributed.destroy_process_group()
    rows = [
        json.loads(line) for line in (Path(cfg.trainer.output_dir) / "metrics.jsonl").read_text().splitlines()
    ]
    return load_hf_config(cfg.model.path), rows


def step_figures(hf, row: dict, rows_per_step: int, peak: float | None) -> dict:
    """Times, tokens/s and the actor update's TFLOP/s and MFU of one metrics.jsonl row."""
    from hybridflow.utils.flops import train_flops_per_token

    seq_len = row["prompt_length/mean"] + row["response_length/mean"]
    tokens = rows_per_step * seq_len
    update_flops = train_flops_per_token(hf, seq_len) * tokens / row["timing/update_actor"]
    return {
        "step": row["step"],
        "gen s": row["timing/gen"],
        "update s": row["timing/update_actor"],
        "step s": row["timing/step"],
        "tokens": int(tokens),
        "tokens/s": row["throughput/tokens_per_s"],
        "update TFLOP/s": update_flops / 1e12,
        "update MFU": f"{100 * update_flops / peak:.1f}%" if peak else "n/a",
    }


def problems(rows: list[dict], steps: int) -> list[str]:
    found = [] if len(rows) == steps else [f"{len(rows)} steps logged, expected {steps}"]
    for row in rows:
        for key in ("actor/pg_loss", "actor/grad_norm"):
            if not math.isfinite(row.get(key, math.nan)):
                found.append(f"step {row['step']}: {key}={row.get(key)}")
    if sys.modules.get("ray") is not None:
        found.append("the in-process path imported Ray, which the GPU machines this check is for lack")
    return found


def memory_line(cuda: bool) -> str:
    import torch

    if cuda:
        allocated, reserved = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
        return f"peak GPU memory: {allocated / 2**30:.2f} GiB allocated, {reserved / 2**30:.2f} GiB reserved"
    return f"peak memory (RSS, CPU run): {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB"


FORMATS = {
    "gen s": "{:.2f}",
    "update s": "{:.2f}",
    "step s": "{:.2f}",
    "tokens/s": "{:,.0f}",
    "update TFLOP/s": "{:.3g}",
}


def print_table(figures: list[dict]) -> None:
    columns = list(figures[0])
    print(" | ".join(columns))
    for fig in figures:
        print(" | ".join(FORMATS.get(column, "{}").format(fig[column]) for column in columns))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", help="the tiny model on CPU (what CI runs)")
    parser.add_argument("--steps", type=int, default=3, help="GRPO steps (default 3)")
    parser.add_argument(
        "--workdir", type=Path, help="where the model, data and metrics go (default: a temp dir)"
    )
    args = parser.parse_args(argv)
    import torch

    cuda = not args.cpu
    if cuda and not torch.cuda.is_available():
        print("error: no CUDA device is visible; run with --cpu for the CPU check", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        workdir = args.workdir or Path(tmp)
        model, data = make_inputs(workdir, cuda)
        hf, rows = train(recipe_overrides(model, data, workdir / "out", cuda, args.steps))
        device = torch.cuda.get_device_name() if cuda else "CPU"
        from hybridflow.utils.flops import peak_bf16_flops

        peak = peak_bf16_flops(device) if cuda else None
        rows_per_step = SETTINGS["cuda" if cuda else "cpu"]["prompts"] * SAMPLES_PER_PROMPT
        what = "Qwen2-0.5B-shaped, bf16, distributed optimizer" if cuda else "tiny model, fp32"
        print(f"\ngpu_check on {device}: {what}, {rows_per_step} sequences per step")
        print_table([step_figures(hf, row, rows_per_step, peak) for row in rows])
        print(memory_line(cuda))
    found = problems(rows, args.steps)
    for problem in found:
        print(f"error: {problem}", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
