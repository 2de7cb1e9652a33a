"""Reductions over the valid (mask == 1) tokens of a padded (B, T) batch.

Shapes: B sequences, T token positions; masks hold 1 for real tokens and 0 for padding.
"""

import torch


def compute_response_mask(responses: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The response part of the attention mask: (B, P+R) mask and (B, R) responses -> (B, R)."""
    response_length = responses.size(1)
    return attention_mask[:, -response_length:]


def last_token_lengths(response_mask: torch.Tensor) -> torch.Tensor:
    """Positions up to and including each row's last masked token: the response's length, also
    when tool output inside it is masked out (agent loops); the mask's sum otherwise. (B, R) -> (B,)"""
    positions = torch.arange(1, response_mask.size(-1) + 1, device=response_mask.device)  # (R,)
    return (response_mask.long() * positions).max(dim=-1).values


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of `values` where `mask` is 1, over `dim` (all dims when None)."""
    masked = values * mask
    return masked.sum() if dim is None else masked.sum(dim=dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of `values` over the positions where `mask` is 1; 0 where there are none."""
    count = mask.sum() if dim is None else mask.sum(dim=dim)
    return masked_sum(values, mask, dim) / count.clamp(min=1)


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Shift and scale `values` to zero mean, unit variance over the masked tokens.

    The variance carries Bessel's correction (n / (n - 1)); a single valid token has
    variance 0 and whitens to 0 (it is its own mean).
    """
    count = mask.sum()
    mean = masked_mean(values, mask)
    var = masked_sum((values - mean) ** 2, mask) / (count - 1).clamp(min=1)  # ()
    return (values - mean) * torch.rsqrt(var + eps)  # (B, T)
