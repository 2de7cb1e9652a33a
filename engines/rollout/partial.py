"""Partial rollouts: what a request interrupted by a weight update continues as.

On a weight update the request-level engine (`engines/rollout/requests.py`) aborts its in-flight
requests, loads the new weights and submits each again as a *segment*: the original prompt plus
every token sampled so far as the new prompt, with what is left of the token budget. The new
prompt is prefilled under the new weights (the prefix cache is emptied first), so every token of
the segment is sampled from, and its log-prob is of, the new policy given the whole sequence.
This is how the peers interrupt generation (slime's fully-async rollout, AReaL's interruptible
generation, verl's fully-async partial rollout: abort, update, resubmit with the tokens so far);
vLLM's own `pause_generation(mode="keep")` would keep the KV cache computed by the old weights,
and the tokens after the update would then be of neither policy.

The decisions are plain functions of their inputs, tested without an engine
(tests/async_rl/test_partial_rollout.py).
"""

from dataclasses import dataclass

from engines.rollout.base import row_seed


@dataclass(frozen=True)
class Segment:
    """What an interrupted request is submitted again as."""

    prompt_ids: list[int]  # the original prompt + the tokens sampled so far
    max_new_tokens: int  # what is left of the request's budget
    seed: int


def continuation(prompt_ids: list[int], sampled: list[int], max_new_tokens: int, seed: int) -> Segment:
    """The next segment of a request of `max_new_tokens` in all that has sampled `sampled`.

    A fresh seed per segment: vLLM seeds a request's generator once, so the request's own seed
    would replay the random draws of its first tokens for the tokens after the update. A request
    interrupted before its first token starts again as it was."""
    left = max_new_tokens - len(sampled)
    if left < 1:
        raise ValueError(
            f"an interrupted request has used its budget: {len(sampled)} tokens sampled, "
            f"max_new_tokens={max_new_tokens}"
        )
    next_seed = row_seed(seed, len(sampled)) if sampled else seed
    return Segment(list(prompt_ids) + list(sampled), left, next_seed)


def stop_across_boundary(text: str, boundary: int, stops: list[str]) -> int | None:
    """The end (in characters of `text`) of the earliest stop string that starts before `boundary`
    and ends after it, or None.

    `text` is the response decoded so far and `boundary` the length of the text sampled before the
    segment began. vLLM matches stop strings on a request's own output text, which for a
    continuation starts at the boundary: a stop string split by the update would go unseen, where
    one uninterrupted request would have stopped on it."""
    ends = []
    for stop in stops:
        start = text.find(stop, max(0, boundary - len(stop) + 1))
        if start != -1 and start < boundary < start + len(stop):
            ends.append(start + len(stop))
    return min(ends, default=None)


def boundary_window_open(text_after: int, stops: list[str]) -> bool:
    """Whether a stop string can still straddle the boundary with `text_after` characters sampled
    after it: one of them must end within its first len(stop) - 1 characters."""
    return any(text_after < len(stop) - 1 for stop in stops)
