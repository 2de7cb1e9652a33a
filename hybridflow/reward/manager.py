"""Scores a batch of responses: decode each response, score it, put the score on its last token.

The text a reward function reads is the model's own tokens only (`response_mask` 1): an agent
loop's response also holds the tool responses appended between its turns (mask 0), and a rule
reward that read them would pay the model for an answer a tool printed. Each sampled turn is
decoded on its own and the turns are joined with a newline, so a GSM8K rule sees the model's last
`#### <answer>` of the episode (its final answer).

A reward function that raises, or returns something other than a number, stops the run with a
`RewardFunctionError` naming the function, the response and its data_source (and what it returned
or raised, with the function's own traceback); a NaN / inf score is a `NonFiniteError`, which
trainer.nonfinite_policy may skip.

An environment's episodes (rollout.agent.loop=environment, hybridflow/agents/environments.py) come
with their rewards, `env_scores` (B, R): those are the scores, in training and in validation.

Shapes: B responses, R response positions (right-padded; `response_mask` is 1 up to and
including EOS).
"""

import inspect
import math
import numbers
import traceback

import torch

from hybridflow.algorithms.masked import last_token_lengths
from hybridflow.protocol import DataProto
from hybridflow.reward.registry import RewardFn
from hybridflow.utils.nonfinite import NonFiniteError

ENV_SCORES = "env_scores"  # an environment's rewards (B, R), written by hybridflow/agents/environments.py


class RewardFunctionError(RuntimeError):
    """A reward function that raised or returned something other than a number; the message names
    the function, the response and its data_source. `user_traceback`: the traceback of what the
    function raised, its own frames only ("" when it returned a wrong value)."""

    def __init__(self, message: str, user_traceback: str = ""):
        super().__init__(message)
        self.user_traceback = user_traceback


def reward_fn_name(reward_fn: RewardFn) -> str:
    return f"{reward_fn.__module__}.{reward_fn.__qualname__}"


def defined_at(fn) -> str:
    """'file.py:12' where `fn` is defined, or '' when Python cannot tell (a builtin, a C function)."""
    try:
        return f"{inspect.getsourcefile(fn)}:{inspect.getsourcelines(fn)[1]}"
    except (OSError, TypeError):
        return ""


def score_one(reward_fn: RewardFn, row: int, source: str, text: str, ground_truth, extra: dict) -> float:
    """`reward_fn`'s score of one response; an error names the function, the row and its
    data_source when the function fails or returns something that is not a finite number."""
    where = f"reward function {reward_fn_name(reward_fn)} on response {row} (data_source {source!r})"
    try:
        score = reward_fn(source, text, ground_truth, extra)
    except Exception as err:
        # tb_next: from the function's own frame on; this frame is hybridflow's, not the user's
        user_frames = "".join(traceback.format_exception(type(err), err, err.__traceback__.tb_next))
        raise RewardFunctionError(f"{where} raised {type(err).__name__}: {err}", user_frames) from err
    if not isinstance(score, numbers.Real):
        at = defined_at(reward_fn)
        raise RewardFunctionError(
            f"{where} returned {score!r} ({type(score).__name__}); it must return a float"
            + (f" (the function is at {at})" if at else "")
        )
    if not math.isfinite(score):
        raise NonFiniteError(f"{where} returned {score}; rewards must be finite numbers")
    return float(score)


def sequence_scores(batch: DataProto, tokenizer, reward_fn: RewardFn) -> torch.Tensor:
    """One float per response: `reward_fn(data_source, decoded response, ground truth, extra_info)`;
    a NaN / inf score raises `NonFiniteError` naming the function and the data_source. Episodes of an
    environment: the sum of each row's `env_scores` instead."""
    if ENV_SCORES in batch.batch:
        return batch.batch[ENV_SCORES].float().sum(dim=-1)  # (B,)
    texts = model_texts(batch.batch["responses"], batch.batch["response_mask"], tokenizer)
    non_tensor = batch.non_tensor_batch
    extra_infos = non_tensor.get("extra_info", [{}] * len(texts))
    scores = [
        score_one(reward_fn, row, source, text, reward_model["ground_truth"], extra or {})
        for row, (source, text, reward_model, extra) in enumerate(
            zip(non_tensor["data_source"], texts, non_tensor["reward_model"], extra_infos, strict=True)
        )
    ]
    return torch.tensor(scores, dtype=torch.float32)  # (B,)


def sampled_runs(ids: torch.Tensor, mask: torch.Tensor) -> list[list[int]]:
    """(R,) ids and mask -> the runs of consecutive ids whose mask is 1 (a trajectory's sampled
    turns), in order."""
    positions = mask.nonzero().flatten()  # (S,) sampled positions, ascending
    if positions.numel() == 0:
        return []
    starts = (positions.diff() > 1).nonzero().flatten() + 1  # where a new run begins in `positions`
    return [ids[run].tolist() for run in positions.tensor_split(starts)]


def model_texts(responses: torch.Tensor, response_mask: torch.Tensor, tokenizer) -> list[str]:
    """(B, R) ids and mask -> each row's sampled turns, each decoded alone, joined by newlines."""
    texts = []
    for ids, mask in zip(responses, response_mask, strict=True):
        turns = tokenizer.batch_decode(sampled_runs(ids, mask), skip_special_tokens=True)
        texts.append("\n".join(turns))
    return texts


def place_on_last_token(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """(B,) sequence scores -> (B, R) token-level scores, nonzero only at each last valid token."""
    token_scores = torch.zeros(response_mask.shape, dtype=torch.float32)  # (B, R)
    last = (last_token_lengths(response_mask) - 1).clamp(min=0)  # (B,)
    token_scores[torch.arange(len(scores)), last] = scores
    return token_scores


def compute_rewards(batch: DataProto, tokenizer, reward_fn: RewardFn) -> DataProto:
    """`token_level_scores` (B, R) for the batch; a reward model's `rm_scores` or an environment's
    `env_scores`, when the batch carries them, are the scores instead of the rule."""
    if ENV_SCORES in batch.batch:
        return DataProto.from_dict({"token_level_scores": batch.batch[ENV_SCORES].float()})
    if "rm_scores" in batch.batch:
        return DataProto.from_dict({"token_level_scores": batch.batch["rm_scores"].float()})
    scores = sequence_scores(batch, tokenizer, reward_fn)
    return DataProto.from_dict(
        {"token_level_scores": place_on_last_token(scores, batch.batch["response_mask"])}
    )
