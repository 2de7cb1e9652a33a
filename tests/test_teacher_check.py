"""The distillation teacher's tokenizer check (hybridflow/checks/distillation.py): the same
tokenizer passes; another vocabulary, the same tokens under other ids, other special ids, or too
few embedding rows are refused naming teacher.path and what differs. (The whole entry point
refusing such a teacher before Ray starts is a row of docs/bad-inputs.md.)"""

import json

import pytest

from hybridflow.checks.distillation import check_teacher_tokenizer, tokenizer_difference
from hybridflow.utils.tiny_model import build_tokenizer


def test_the_same_tokenizer_has_no_difference():
    assert tokenizer_difference(build_tokenizer(), build_tokenizer()) is None


def test_an_extra_token_is_a_vocabulary_difference():
    teacher = build_tokenizer()
    teacher.add_tokens(["<|teacher|>"])
    assert tokenizer_difference(build_tokenizer(), teacher) == (
        "the vocabularies have 263 (student) and 264 (teacher) tokens"
    )


def test_another_end_of_sequence_token_is_named():
    student, teacher = build_tokenizer(), build_tokenizer()
    teacher.eos_token = "<|assistant|>"
    difference = tokenizer_difference(student, teacher)
    assert difference.startswith(f"eos_token_id is {student.eos_token_id} for the student, ")
    assert difference.endswith(f"{teacher.eos_token_id} for the teacher")


def test_the_same_words_under_other_ids_are_named():
    student = {"a": 0, "b": 1, "c": 2}
    teacher = {"a": 0, "b": 2, "c": 1}

    class Vocab:
        def __init__(self, vocab):
            self.vocab = vocab

        def get_vocab(self):
            return self.vocab

    assert (
        tokenizer_difference(Vocab(student), Vocab(teacher))
        == "token 'b' is id 1 for the student, id 2 for the teacher"
    )


def save(tokenizer, directory, vocab_size: int):
    tokenizer.save_pretrained(directory)
    (directory / "config.json").write_text(json.dumps({"vocab_size": vocab_size}))
    return directory


def test_check_refuses_by_teacher_path(tmp_path):
    student_dir = save(build_tokenizer(), tmp_path / "student", 263)
    teacher = build_tokenizer()
    teacher.add_tokens(["<|teacher|>"])
    teacher_dir = save(teacher, tmp_path / "teacher", 264)
    with pytest.raises(
        ValueError, match=f"teacher.path={teacher_dir} does not share the student's tokenizer"
    ):
        check_teacher_tokenizer(str(teacher_dir), build_tokenizer(), str(student_dir))


def test_check_refuses_a_teacher_with_fewer_embedding_rows(tmp_path):
    student_dir = save(build_tokenizer(), tmp_path / "student", 300)
    teacher_dir = save(build_tokenizer(), tmp_path / "teacher", 263)
    with pytest.raises(ValueError, match=r"has 263 embedding rows .* fewer than the student.s 300"):
        check_teacher_tokenizer(str(teacher_dir), build_tokenizer(), str(student_dir))
    check_teacher_tokenizer(str(student_dir), build_tokenizer(), str(teacher_dir))  # more rows: fine
