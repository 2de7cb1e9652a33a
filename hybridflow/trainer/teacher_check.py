"""The distillation teacher must read the student's token ids as the student does: it scores the
ids the student sampled, never text, so a teacher with another vocabulary (or the same words under
other ids, or other special tokens) would score different tokens without any error. Checked by the
preflight before Ray starts, by comparing the two tokenizers and the teacher's embedding rows.
"""

import json
from pathlib import Path

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
