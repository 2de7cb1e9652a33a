"""Parity of the Megatron-Core side on one GPU: the suite's CPU parity workers (tests/megatron), each
run as one rank on CUDA against transformers on the CPU (fp32, 1e-5), at TP1.

    bash scripts/gpu_check.sh --parity [--wheels DIR]
    python scripts/gpu_parity.py [--workdir DIR]

- models: `_model_parity_worker.py` at 1x1 (Qwen2, Llama, Qwen3, Qwen3-MoE, Mixtral): logits,
  log-probs, top-K, gradients through the schedule, weight round trip, export, value head;
- vlm: `_vlm_parity_worker.py` on the tiny LLaVA model (Qwen2 text);
- teacher: `_teacher_parity_worker.py` at TP1, padded and packed;
- train: `_train_parity.py`'s steps, checked as tests/megatron/test_train_parity.py checks them
  (PPO updates against its transformers reference, critic, SFT, packed == padded), plus the update
  after an offload round trip, a checkpoint save and a load, against the same steps on the CPU.
Prints a line per passed check and the output of a failed one; exits 1 when any failed.
"""

import argparse
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "tests"), str(REPO / "tests" / "megatron")]
TRAIN_STEPS = ["actor:token-mean", "actor:seq-mean-token-mean", "critic", "sft",
               "heavy-actor:token-mean:padded", "heavy-actor:token-mean:packed", "packing"]  # fmt: skip


def one_rank(script: str, *args, cpu: bool = False) -> str:
    """The worker's output; RuntimeError with its tail when it failed."""
    from launch import run_distributed

    return run_distributed(script, 1, *args, timeout=900, env={"CUDA_VISIBLE_DEVICES": ""} if cpu else None)


def worker_checks(work: Path) -> dict:
    from tiny_hf import make_tiny_hf_checkpoint

    from hybridflow.utils.tiny_vlm import make_tiny_vlm

    vlm = make_tiny_vlm(work / "vlm", text_arch="qwen2")
    teacher = make_tiny_hf_checkpoint(work / "teacher", arch="llama", num_layers=2, tie_word_embeddings=True)
    return {
        "models": lambda: one_rank(
            "_model_parity_worker.py", "--work-dir", work / "models", "--layouts", "1x1x1"
        ),
        "vlm": lambda: one_rank("_vlm_parity_worker.py", "--hf-dir", vlm, "--out-dir", work / "vlm_export"),
        "teacher": lambda: one_rank("_teacher_parity_worker.py", "--teacher", teacher, "--tp", 1),
    }


def train_checks(work: Path) -> dict:
    """Runs `_train_parity.py` on the GPU and, for the step after a checkpoint, on the CPU."""
    import test_train_parity as t
    import torch

    hf_dir = t.make_tiny_hf_checkpoint(work / "hf", num_layers=4, vocab_size=t.VOCAB, seed=3)
    batch = t._make_batch(hf_dir)
    lengths = t.heavy_tailed_lengths(8, median=4.0, sigma=1.0, cap=t.HEAVY_RESPONSE_LEN, seed=4)
    heavy = t._make_batch(hf_dir, [2, 6, 5, 1, 3, 6, 4, 2], lengths, t.HEAVY_RESPONSE_LEN)
    torch.save(batch, work / "batch.pt")
    torch.save(heavy, work / "heavy.pt")
    for tag, cpu in (("gpu", False), ("cpu", True)):
        steps = ["actor:token-mean", f"save:ckpt_{tag}"] + (TRAIN_STEPS[1:] if tag == "gpu" else [])
        one_rank("_train_parity.py", work, 1, 1, tag, *steps, cpu=cpu)
    gpu, cpu = (torch.load(work / f"{tag}.pt", map_location="cpu") for tag in ("gpu", "cpu"))
    runs = {"root": work, "hf": hf_dir, "batch": batch, "heavy": heavy, "tp1": gpu}
    packed = "heavy-actor:token-mean:packed"
    against_transformers = t.test_single_rank_update_matches_transformers_reference
    return {
        "train ppo token-mean": lambda: against_transformers(runs, "token-mean"),
        "train ppo seq-mean-token-mean": lambda: against_transformers(runs, "seq-mean-token-mean"),
        "train critic values": lambda: t.test_critic_values_cover_response_positions_only(runs),
        "train sft": lambda: t.test_sft_loss_decreases_on_a_memorisable_batch(runs),
        "train packed forward": lambda: t.test_packed_forward_and_gradients_equal_padded(runs, "tp1"),
        "train packed update": lambda: t.test_packed_token_budget_update_equals_padded_fixed_micro_batches(
            runs, "tp1", packed
        ),
        "train after offload, save, load": lambda: t._assert_weights_close(
            gpu["after_save"]["weights"], cpu["after_save"]["weights"]
        ),
    }


def run_checks(checks: dict) -> int:
    failed = 0
    for name, check in checks.items():
        try:
            output = check()
        except Exception as err:  # every check reports; the exit code counts them
            failed += 1
            print(f"FAILED {name}: {str(err)[-3000:]}", flush=True)
            continue
        lines = [line for line in (output or "").splitlines() if "PARITY OK" in line]
        print("\n".join(lines) if lines else f"OK {name}", flush=True)
    return failed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, help="where models and results go (default: a temp dir)")
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("error: no CUDA device is visible; the suite runs these workers on CPU", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        work = args.workdir or Path(tmp)
        failed = run_checks(worker_checks(work))
        try:
            failed += run_checks(train_checks(work / "train"))
        except RuntimeError as err:
            failed += 1
            print(f"FAILED train: {str(err)[-3000:]}", flush=True)
    verdict = f"{failed} failed" if failed else "all passed"
    print(f"gpu_parity on {torch.cuda.get_device_name()}: {verdict}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
