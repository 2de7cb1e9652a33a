"""On-policy distillation: a teacher exactly when distillation is on, coefficients that keep its
signal, no teacher setting left unread; and the teacher's tokenizer against the student's.

The teacher must read the student's token ids as the student does: it scores the ids the student
sampled, never text, so a teacher with another vocabulary (or the same words under other ids, or
other special tokens) would score different tokens without any error. `check_teacher_tokenizer`
compares the two tokenizers and the teacher's embedding rows before Ray starts.
"""

import json
import math
from pathlib import Path

from hybridflow.checks.roles import uses_teacher
from hybridflow.checks.settings import _changed_fields, _no_effect
from hybridflow.config.schema import RecipeConfig


def _check_distillation(cfg: RecipeConfig) -> list[str]:
    """A teacher exactly when distillation is on, and coefficients that keep its signal."""
    distill, teacher = cfg.algorithm.distillation, cfg.teacher
    if not uses_teacher(cfg):
        if teacher.path is not None and cfg.trainer.mode == "rl":
            return [
                f"teacher.path={teacher.path} is set but algorithm.distillation.enable=false: set "
                "algorithm.distillation.enable=true to distil from it, or remove teacher.path"
            ]
        return []
    errors = []
    if teacher.path is None:
        errors.append(
            "algorithm.distillation.enable=true needs teacher.path: a Hugging Face model directory or Hub "
            "id whose tokenizer is the student's"
        )
    if distill.kl_coef <= 0:
        errors.append(
            f"algorithm.distillation.kl_coef must be positive (the teacher's weight), got {distill.kl_coef}"
        )
    if distill.task_coef < 0:
        errors.append(
            f"algorithm.distillation.task_coef must be >= 0 (0: pure distillation), got {distill.task_coef}"
        )
    if teacher.n_gpus_per_node < 0:
        errors.append(
            "teacher.n_gpus_per_node must be >= 0 (0: in the actor's processes), got "
            f"{teacher.n_gpus_per_node}"
        )
    if teacher.log_prob_micro_batch_size <= 0:
        errors.append(
            f"teacher.log_prob_micro_batch_size must be positive, got {teacher.log_prob_micro_batch_size}"
        )
    return errors


def _check_distillation_weights_finite(cfg: RecipeConfig) -> list[str]:
    """An infinite weight passes the sign checks but makes every advantage infinite."""
    if not uses_teacher(cfg):
        return []
    distillation = cfg.algorithm.distillation
    return [
        f"algorithm.distillation.{key}={value} must be finite: an infinite weight makes every advantage "
        "infinite"
        for key, value in (("kl_coef", distillation.kl_coef), ("task_coef", distillation.task_coef))
        if math.isinf(value)
    ]


def _distillation_in_sft(cfg: RecipeConfig) -> list[str]:
    """The switches that ask for distillation in an SFT run, which never distils (other RL-only
    settings are ignored there, as the rest of the teacher's)."""
    if cfg.trainer.mode != "sft":
        return []
    changed = _changed_fields(cfg.algorithm.distillation, "algorithm.distillation", ("enable",))
    changed += _changed_fields(cfg.teacher, "teacher", ("path",))
    return _no_effect(
        changed, "trainer.mode=sft", ": on-policy distillation runs in trainer.mode=rl; remove {it}"
    )


def _distillation_settings_unread(cfg: RecipeConfig) -> list[str]:
    """The teacher's and the distillation's settings in an RL run without distillation
    (teacher.path has its own error, in _check_distillation)."""
    if uses_teacher(cfg) or cfg.trainer.mode != "rl":
        return []
    distillation, teacher = cfg.algorithm.distillation, cfg.teacher
    changed = _changed_fields(
        distillation, "algorithm.distillation", ("kl_coef", "task_coef", "kl_estimator")
    )
    changed += _changed_fields(
        teacher,
        "teacher",
        ("megatron", "n_gpus_per_node", "log_prob_micro_batch_size", "log_prob_max_token_len_per_gpu"),
    )
    return _no_effect(
        changed,
        "algorithm.distillation.enable=false",
        ": set algorithm.distillation.enable=true to distil from teacher.path, or remove {it}",
    )


SPECIAL_IDS = ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id")


def tokenizer_difference(student, teacher) -> str | None:
    """What differs between two tokenizers' vocabularies and special ids (None: nothing)."""
    student_vocab, teacher_vocab = student.get_vocab(), teacher.get_vocab()
    if student_vocab != teacher_vocab:
        return _vocab_difference(student_vocab, teacher_vocab)
    for name in SPECIAL_IDS:
        if getattr(student, name) != getattr(teacher, name):
            ours, theirs = getattr(student, name), getattr(teacher, name)
            return f"{name} is {ours} for the student, {theirs} for the teacher"
    if sorted(student.all_special_ids) != sorted(teacher.all_special_ids):
        return (
            f"the special token ids differ: {sorted(student.all_special_ids)} for the student, "
            f"{sorted(teacher.all_special_ids)} for the teacher"
        )
    return None


def _vocab_difference(student: dict[str, int], teacher: dict[str, int]) -> str:
    if len(student) != len(teacher):
        return f"the vocabularies have {len(student)} (student) and {len(teacher)} (teacher) tokens"
    token = next(t for t in sorted(student) if teacher.get(t) != student[t])
    where = f"id {teacher[token]}" if token in teacher else "not in its vocabulary"
    return f"token {token!r} is id {student[token]} for the student, {where} for the teacher"


def check_teacher_tokenizer(teacher_path: str, student_tokenizer, student_model_dir: str) -> None:
    """ValueError naming teacher.path unless its tokenizer is the student's and its embedding has
    a row for every id the student can sample (the student's config.json vocab_size)."""
    from transformers import AutoTokenizer

    try:
        teacher = AutoTokenizer.from_pretrained(teacher_path)
    except (OSError, ValueError, KeyError, IndexError, TypeError) as err:
        raise ValueError(
            f"teacher.path={teacher_path}: its tokenizer does not load ({type(err).__name__}: {err}); the "
            "teacher must ship the student's tokenizer"
        ) from None
    difference = tokenizer_difference(student_tokenizer, teacher)
    if difference:
        raise ValueError(
            f"teacher.path={teacher_path} does not share the student's tokenizer: {difference}; "
            "distillation scores the student's token ids, so choose a teacher of the same tokenizer family"
        )
    rows = {
        key: _vocab_size(Path(path))
        for key, path in (("teacher", teacher_path), ("student", student_model_dir))
    }
    if rows["teacher"] < rows["student"]:
        raise ValueError(
            f"teacher.path={teacher_path} has {rows['teacher']} embedding rows (config.json vocab_size), "
            f"fewer than the student's {rows['student']}: it could not score every id the student may sample"
        )


def _vocab_size(model_dir: Path) -> int:
    return int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
