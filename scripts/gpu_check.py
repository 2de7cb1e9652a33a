"""The one-command GPU check (what `scripts/gpu_check.sh` runs once its wheels are installed).

GRPO steps of `recipes/quickstart.yaml` (arithmetic prompts, rule reward) with the Megatron-Core
actor and the `hf` rollout, trained in this process through `LocalWorkerGroup`: no Ray, SGLang or
Transformer Engine is needed. On CUDA: a random Qwen2-0.5B-shaped model (24 layers, hidden 896,
14 query / 2 KV heads, MLP 4864, vocabulary 151936, tied embeddings, built by
`hybridflow.utils.tiny_model`) in bf16 with Megatron-Core's distributed optimizer; `--cpu`: the
tiny model in fp32 on CPU (the CI run of the same code path). `--vlm`: `recipes/vlm_quickstart.yaml`
instead, the tiny LLaVA (`hybridflow.utils.tiny_vlm`) naming the quadrant of a shapes image, its
pixels through the rollout, the log-probs and the update, the vision tower and projector synced.
`--model DIR --data DIR` train a given checkpoint on a given folder's train.parquet (a warm start)
and `--set KEY=VALUE` adds recipe overrides after the check's own. Prints per step the generation,
actor-update and step times, tokens/s (prompt + response tokens of the step / step time), the
actor update's achieved TFLOP/s and MFU (`hybridflow.utils.flops`; real tokens only; a VLM's
language model only), the peak memory (CUDA allocator peak on GPU, peak RSS on CPU) and any
held-out accuracy the overrides asked for. Exits 1 when a step is missing, a loss or grad norm is
not finite, or Ray was imported (the machines this is for have none).

    bash scripts/gpu_check.sh [--cpu] [--vlm] [--wheels DIR] [--steps N]
    python scripts/gpu_check.py [--cpu] [--vlm] [--steps N] [--workdir DIR] [--model M --data D] [--set K=V]
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
# Per task and device: prompts per step (x 8 samples), response length, micro-batch rows (update,
# log-probs). The VLM task keeps its recipe's batch on CUDA and its 24-token answers.
SETTINGS = {
    ("text", "cuda"): dict(prompts=32, response_length=256, micro=16, log_prob_micro=32),
    ("text", "cpu"): dict(prompts=8, response_length=16, micro=16, log_prob_micro=32),
    ("vlm", "cuda"): dict(prompts=128, response_length=24, micro=64, log_prob_micro=64),
    ("vlm", "cpu"): dict(prompts=4, response_length=24, micro=16, log_prob_micro=32),
}
RECIPES = {"text": "quickstart.yaml", "vlm": "vlm_quickstart.yaml"}
SAMPLES_PER_PROMPT = 8  # the quickstart recipe's rollout.sampling.n


def recipe_overrides(
    model: Path, data: dict, out: Path, cuda: bool, steps: int, task: str = "text"
) -> list[str]:
    """key=value settings over the task's recipe (RECIPES) for a one-process run of `steps` steps."""
    s = SETTINGS[task, "cuda" if cuda else "cpu"]
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


def make_inputs(workdir: Path, cuda: bool, task: str) -> tuple[Path, dict]:
    """(model, {"train": parquet}) for the task: a random model and its data written in `workdir`."""
    if task == "vlm":
        from hybridflow.data.shapes import ShapesConfig, write_shapes_parquet
        from hybridflow.utils.tiny_vlm import make_tiny_vlm

        data = write_shapes_parquet(workdir / "data", ShapesConfig(task="quadrant"))
        return make_tiny_vlm(workdir / "model"), data
    from hybridflow.data.arith import write_arith_parquet
    from hybridflow.utils.tiny_model import make_tiny_model

    shape = QWEN2_05B_SHAPE if cuda else {}
    return make_tiny_model(workdir / "model", **shape), write_arith_parquet(workdir / "data")


def train(recipe: str, overrides: list[str]):
    """Run the GRPO steps of recipes/<recipe> in this process; (its metrics.jsonl rows, the config)."""
    import torch

    from hybridflow.single_controller import LocalWorkerGroup, RayClassWithInitArgs
    from hybridflow.trainer.main import prepare
    from hybridflow.trainer.policy import Policy
    from hybridflow.trainer.ppo_trainer import PPOTrainer
    from hybridflow.trainer.roles import Roles
    from hybridflow.workers.hybrid_policy import HybridPolicyWorker

    cfg, layout = prepare([str(REPO / "recipes" / recipe), *overrides])
    group = LocalWorkerGroup(ray_cls_with_init=RayClassWithInitArgs(HybridPolicyWorker, cfg))
    try:
        group.init_model()
        roles = Roles(Policy(group), rollout_group=None, critic=None, reward_model=None, groups=[group])
        PPOTrainer(cfg, roles, actor_dp=layout.actor_dp).fit(None)
    finally:
        group.shutdown()
        if torch.distributed.is_initialized():  # the in-process rank's group (NCCL warns at exit)
            torch.distributed.destroy_process_group()
    lines = (Path(cfg.trainer.output_dir) / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines], cfg


def language_model_config(model: Path, task: str):
    """The HF config whose decoder the MFU counts: a VLM's language model (its tower is frozen)."""
    if task == "vlm":
        from engines.megatron.vlm_config import load_vlm_config

        return load_vlm_config(model).text
    from engines.megatron.model import load_hf_config

    return load_hf_config(model)


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
    """What is wrong with the training rows (metrics.jsonl rows of steps; validation-only rows left out)."""
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


DTYPE_NAMES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def describe(task: str, cuda: bool, cfg) -> str:
    """The run in a few words, as its config ran it (overrides may change the check's dtype)."""
    model = "tiny LLaVA" if task == "vlm" else "Qwen2-0.5B-shaped" if cuda else "tiny model"
    megatron = cfg.actor.megatron
    dtype = DTYPE_NAMES[megatron.params_dtype]
    optimizer = ", distributed optimizer" if cuda and megatron.use_distributed_optimizer else ""  # GPU only
    return f"{model}, {dtype}{optimizer}, {sequences_per_step(cfg)} sequences per step"


def sequences_per_step(cfg) -> int:
    return cfg.data.train_batch_size * cfg.rollout.sampling.n


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


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", help="the tiny model on CPU (what CI runs)")
    parser.add_argument(
        "--vlm", action="store_true", help="recipes/vlm_quickstart.yaml: the tiny LLaVA on the shapes task"
    )
    parser.add_argument("--steps", type=int, default=3, help="GRPO steps (default 3)")
    parser.add_argument(
        "--workdir", type=Path, help="where the model, data and metrics go (default: a temp dir)"
    )
    parser.add_argument("--model", type=Path, help="train this HF checkpoint instead of a random model")
    parser.add_argument("--data", type=Path, help="with --model: a folder with its train.parquet")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="more recipe overrides, last"
    )
    args = parser.parse_args(argv)
    if (args.model is None) != (args.data is None):
        parser.error("--model and --data go together (a checkpoint and the folder of its train.parquet)")
    return args


def inputs(args: argparse.Namespace, workdir: Path, cuda: bool, task: str) -> tuple[Path, dict]:
    if args.model is not None:
        return args.model, {"train": args.data / "train.parquet"}
    return make_inputs(workdir, cuda, task)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    cuda, task = not args.cpu, "vlm" if args.vlm else "text"
    if cuda and not torch.cuda.is_available():
        print("error: no CUDA device is visible; run with --cpu for the CPU check", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        workdir = args.workdir or Path(tmp)
        model, data = inputs(args, workdir, cuda, task)
        overrides = recipe_overrides(model, data, workdir / "out", cuda, args.steps, task)
        rows, cfg = train(RECIPES[task], overrides + args.set)
        steps = [row for row in rows if "timing/step" in row]
        device = torch.cuda.get_device_name() if cuda else "CPU"
        from hybridflow.utils.flops import peak_bf16_flops

        peak = peak_bf16_flops(device) if cuda else None
        print(f"\ngpu_check on {device}: {describe(task, cuda, cfg)}")
        hf = language_model_config(model, task)
        print_table([step_figures(hf, row, sequences_per_step(cfg), peak) for row in steps])
        print(memory_line(cuda))
        for row in rows:
            if "val/accuracy" in row:
                print(f"val/accuracy at step {row['step']}: {row['val/accuracy']:.3f}")
    found = problems(steps, args.steps)
    for problem in found:
        print(f"error: {problem}", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
