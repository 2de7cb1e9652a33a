"""GSM8K rule reward, the data-source registry, custom reward functions and token placement."""

import inspect
import sys
import textwrap

import numpy as np
import pytest
import torch

from hybridflow.protocol import DataProto
from hybridflow.reward import gsm8k
from hybridflow.reward.manager import (
    RewardFunctionError,
    compute_rewards,
    place_on_last_token,
    sequence_scores,
)
from hybridflow.reward.registry import REWARD_FN_PARAMETERS, load_reward_fn, rule_reward_fn
from hybridflow.utils.nonfinite import NonFiniteError
from hybridflow.utils.tiny_model import build_tokenizer


@pytest.mark.parametrize(
    ("response", "expected"),
    [
        ("48/2 = 24, 48+24 = 72\n#### 72", "72"),
        ("#### 1,200", "1200"),
        ("#### $18.", "18"),
        ("#### -3.5", "-3.5"),
        ("first #### 5 then corrected #### 6", "6"),  # the last answer counts
        ("the answer is 72", None),  # strict: no "####"
        ("#### seventy-two", None),
        ("#### ,", None),
    ],
)
def test_extract_answer_is_strict_and_takes_the_last(response, expected):
    assert gsm8k.extract_answer(response) == expected


def test_extract_answer_only_reads_the_tail():
    assert gsm8k.extract_answer("#### 1" + "x" * gsm8k.TAIL_CHARS) is None


def test_score_is_one_when_right_format_score_when_wrong_zero_without_answer():
    assert gsm8k.compute_score("so #### 1,200", "1200") == 1.0
    assert gsm8k.compute_score("so #### 1,200", "1,200") == 1.0
    assert gsm8k.compute_score("#### 7", "8") == 0.0
    assert gsm8k.compute_score("#### 7", "8", format_score=0.1) == 0.1
    assert gsm8k.compute_score("7", "8", format_score=0.1) == 0.0


def test_rule_reward_picks_the_rule_by_data_source_and_names_unknown_sources():
    fn = rule_reward_fn(format_score=0.25)
    assert fn("openai/gsm8k", "#### 3", "3", {}) == 1.0
    assert fn("openai/gsm8k", "#### 4", "3", {}) == 0.25
    with pytest.raises(ValueError, match=r"my/data.*reward\.custom_fn"):
        fn("my/data", "#### 3", "3", {})


def test_custom_reward_fn_signature_is_pinned(tmp_path, monkeypatch):
    assert REWARD_FN_PARAMETERS == ("data_source", "solution_str", "ground_truth", "extra_info")
    assert tuple(inspect.signature(rule_reward_fn()).parameters) == REWARD_FN_PARAMETERS
    (tmp_path / "my_rewards.py").write_text(
        textwrap.dedent(
            """
            def length(data_source, solution_str, ground_truth, extra_info):
                return float(len(solution_str))

            def wrong(response, answer):
                return 0.0
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "my_rewards", raising=False)
    assert load_reward_fn("my_rewards.length")("s", "abc", "1", {}) == 3.0
    with pytest.raises(TypeError, match=r"my_rewards\.wrong.*\('response', 'answer'\)"):
        load_reward_fn("my_rewards.wrong")
    with pytest.raises(ValueError, match="cannot be imported"):
        load_reward_fn("my_rewards.missing")
    with pytest.raises(ValueError, match="dotted path"):
        load_reward_fn("length")


def test_place_on_last_token():
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]])
    out = place_on_last_token(torch.tensor([0.5, 1.0, 2.0]), mask)
    assert out.tolist() == [[0, 0, 0.5, 0], [1.0, 0, 0, 0], [0, 0, 0, 2.0]]


def _response_batch(tokenizer, texts: list[str], truths: list[str]) -> DataProto:
    eos = tokenizer.eos_token_id
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"] + [eos] for t in texts]
    length = max(map(len, ids)) + 2
    responses = torch.full((len(ids), length), tokenizer.pad_token_id)
    mask = torch.zeros((len(ids), length), dtype=torch.long)
    for row, seq in enumerate(ids):
        responses[row, : len(seq)] = torch.tensor(seq)
        mask[row, : len(seq)] = 1
    return DataProto.from_dict(
        tensors={"responses": responses, "response_mask": mask},
        non_tensors={
            "data_source": np.array(["openai/gsm8k"] * len(texts), dtype=object),
            "reward_model": np.array([{"ground_truth": t} for t in truths], dtype=object),
        },
    )


def test_compute_rewards_decodes_valid_tokens_and_scores_the_last_one():
    tokenizer = build_tokenizer()
    batch = _response_batch(tokenizer, ["2+2=4\n#### 4", "#### 5", "no"], ["4", "4", "4"])
    assert sequence_scores(batch, tokenizer, rule_reward_fn()).tolist() == [1.0, 0.0, 0.0]
    scores = compute_rewards(batch, tokenizer, rule_reward_fn()).batch["token_level_scores"]
    last = batch.batch["response_mask"].sum(-1) - 1
    assert scores[0, last[0]] == 1.0 and scores.sum() == 1.0


def test_reward_model_scores_replace_the_rule():
    tokenizer = build_tokenizer()
    batch = _response_batch(tokenizer, ["#### 4"], ["4"])
    rm = torch.zeros_like(batch.batch["responses"], dtype=torch.float32)
    rm[0, 1] = -0.5
    batch.batch["rm_scores"] = rm
    assert torch.equal(compute_rewards(batch, tokenizer, rule_reward_fn()).batch["token_level_scores"], rm)


def nan_reward(data_source, solution_str, ground_truth, extra_info):
    return float("nan") if "5" in solution_str else 1.0


def inf_reward(data_source, solution_str, ground_truth, extra_info):
    return float("-inf")


def text_reward(data_source, solution_str, ground_truth, extra_info):
    return "1.0"


def failing_reward(data_source, solution_str, ground_truth, extra_info):
    raise KeyError("answer")


@pytest.mark.parametrize(
    ("reward_fn", "error", "message"),
    [
        (
            nan_reward,
            NonFiniteError,
            r"test_reward\.nan_reward on response 1 \(data_source 'openai/gsm8k'\) returned nan",
        ),
        (
            inf_reward,
            NonFiniteError,
            r"test_reward\.inf_reward on response 0 \(data_source 'openai/gsm8k'\) returned -inf",
        ),
        (
            text_reward,
            RewardFunctionError,
            r"test_reward\.text_reward on response 0 .* returned '1\.0' \(str\)",
        ),
        (
            failing_reward,
            RewardFunctionError,
            r"test_reward\.failing_reward on response 0 .* raised KeyError",
        ),
    ],
)
def test_bad_reward_values_name_the_function_response_and_data_source(reward_fn, error, message):
    tokenizer = build_tokenizer()
    batch = _response_batch(tokenizer, ["#### 4", "#### 5"], ["4", "4"])
    with pytest.raises(error, match=message):
        sequence_scores(batch, tokenizer, reward_fn)


def none_reward(data_source, solution_str, ground_truth, extra_info):
    return None


def test_a_failing_reward_function_keeps_its_own_traceback_and_nothing_of_hybridflow():
    tokenizer = build_tokenizer()
    batch = _response_batch(tokenizer, ["#### 4"], ["4"])
    with pytest.raises(RewardFunctionError) as raised:
        sequence_scores(batch, tokenizer, failing_reward)
    frames = raised.value.user_traceback
    assert frames.startswith("Traceback (most recent call last):\n")
    assert frames.count(f'File "{__file__}"') == 1 and 'raise KeyError("answer")' in frames
    assert "reward/manager.py" not in frames and frames.rstrip().endswith("KeyError: 'answer'")


def test_a_reward_function_returning_none_is_named_with_where_it_is_defined():
    tokenizer = build_tokenizer()
    batch = _response_batch(tokenizer, ["#### 4"], ["4"])
    with pytest.raises(RewardFunctionError) as raised:
        sequence_scores(batch, tokenizer, none_reward)
    line = none_reward.__code__.co_firstlineno
    assert str(raised.value) == (
        "reward function test_reward.none_reward on response 0 (data_source 'openai/gsm8k') returned None "
        f"(NoneType); it must return a float (the function is at {__file__}:{line})"
    )
    assert raised.value.user_traceback == ""
