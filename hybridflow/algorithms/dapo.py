"""DAPO's data-side pieces (Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning
System at Scale", arXiv:2503.14476): dynamic sampling's group filter (section 3.2) and overlong
reward shaping (section 3.4). Clip-higher and the token-level loss are `compute_policy_loss`'s
asymmetric clip range and `agg_loss`'s "token-mean".
"""

from collections import defaultdict
from collections.abc import Sequence

import torch


def groups_with_reward_variance(scores: torch.Tensor, index: Sequence) -> torch.Tensor:
    """(B,) bool: True for the responses whose prompt group (equal `index`) has at least two
    different scores. DAPO drops the other groups (all correct or all wrong): their group-relative
    advantages are all zero, so they only dilute the batch's gradient."""
    if len(index) != scores.size(0):
        raise ValueError(f"index has {len(index)} entries but there are {scores.size(0)} scores")
    rows_of: dict = defaultdict(list)
    for row, key in enumerate(index):
        rows_of[key].append(row)
    keep = torch.zeros(scores.size(0), dtype=torch.bool)  # (B,)
    for rows in rows_of.values():
        group = scores[rows]  # (G,)
        keep[rows] = bool((group != group[0]).any())
    return keep


def overlong_penalty(
    response_lengths: torch.Tensor, max_length: int, buffer_length: int, penalty_factor: float = 1.0
) -> torch.Tensor:
    """DAPO's soft overlong punishment (eq. 13), (B,) from (B,) response lengths in tokens:

        0                                    if |y| <= L_max - L_cache
        ((L_max - L_cache) - |y|) / L_cache  if L_max - L_cache < |y| <= L_max
        -1                                   if |y| > L_max

    scaled by `penalty_factor` and added to the rule reward. L_max is `max_length`, L_cache the
    `buffer_length` of the soft zone before it.
    """
    if not 0 < buffer_length <= max_length:
        raise ValueError(f"buffer_length must be in (0, max_length={max_length}], got {buffer_length}")
    expected = max_length - buffer_length
    lengths = response_lengths.to(torch.float32)  # (B,)
    penalty = ((expected - lengths) / buffer_length).clamp(min=-1.0, max=0.0)  # (B,)
    return penalty * penalty_factor
