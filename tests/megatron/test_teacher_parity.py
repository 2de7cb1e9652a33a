"""The distillation teacher's per-token log-probs equal transformers' on the same tokens (fp32,
1e-5), through the role the trainer runs (hybridflow/workers/teacher.py), padded and packed, with
the teacher split over two tensor-parallel ranks. The checks live in _teacher_parity_worker.py."""

from launch import run_distributed
from tiny_hf import make_tiny_hf_checkpoint


def test_teacher_log_probs_equal_transformers_at_tp2(tmp_path):
    tp = 2
    # Llama with tied embeddings: another architecture than the Qwen2 student, the same tokenizer
    teacher = make_tiny_hf_checkpoint(
        tmp_path / "teacher", arch="llama", num_layers=2, tie_word_embeddings=True
    )
    output = run_distributed("_teacher_parity_worker.py", 2, "--teacher", teacher, "--tp", tp, timeout=600)
    for mode in ("padded", "packed"):
        for rank in range(2):
            line = f"TEACHER PARITY OK {mode} tp={tp} rank={rank}"
            assert line in output, f"missing {line!r} in:\n{output[-4000:]}"
