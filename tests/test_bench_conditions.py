"""The benchmark harness's rules for comparing engines (benchmarks/_conditions.py):
alternating rounds, medians with spreads, and no ratio when the machine's load moved."""

import pytest

from benchmarks._conditions import LOAD_LIMIT, LoadSamples, alternating, ratio_text, summary


def test_cases_alternate_round_by_round_and_the_load_is_sampled_at_each_round_and_the_end():
    calls = []

    def case(name: str, seconds: float):
        return lambda: calls.append(name) or seconds

    loads = LoadSamples(before=0.0)
    seconds = alternating({"hf": case("hf", 2.0), "vllm": case("vllm", 1.0)}, repeats=3, loads=loads)
    assert calls == ["hf", "vllm"] * 3
    assert seconds == {"hf": [2.0] * 3, "vllm": [1.0] * 3}
    assert len(loads.rounds) == 4


def test_summary_is_the_median_and_the_range_over_the_median():
    assert summary([3.0, 1.0, 2.0]) == (2.0, 1.0)
    assert summary([4.0, 4.0, 5.0]) == (4.0, 0.25)


def test_a_ratio_of_medians_while_the_load_held_still():
    loads = LoadSamples(before=0.1, rounds=[0.1, 2.0, 2.2, 2.1])  # the first: before any work
    assert ratio_text(3.0, 1.0, loads) == "3.00x hf"


def test_no_ratio_when_a_foreign_job_moved_the_load_during_the_rounds():
    loads = LoadSamples(before=0.1, rounds=[0.1, 2.0, 2.0 + LOAD_LIMIT + 0.5, 2.1])
    text = ratio_text(3.0, 1.0, loads)
    assert text.startswith("no ratio: the load moved by") and "x hf" not in text
    assert loads.moved() == pytest.approx(LOAD_LIMIT + 0.5)
