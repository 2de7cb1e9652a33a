"""The distribution a rollout engine samples from under top-k and top-p (nucleus) sampling: the
softmax of logits / T renormalised over the tokens the filters keep (Fan et al. 2018,
"Hierarchical Neural Story Generation", top-k; Holtzman et al. 2020, "The Curious Case of Neural
Text Degeneration", top-p). The actor computes its log-probs, entropies and the reference's in this
distribution, so they are those of the policy that sampled (docs/sampling.md).

The kept set is the one vLLM 0.32's sampler keeps (`apply_top_k_top_p_pytorch`,
vllm/v1/sample/ops/topk_topp_sampler.py) and transformers' warpers keep (`TopKLogitsWarper`, then
`TopPLogitsWarper`): top-k keeps every token whose logit is at least the k-th largest (ties
kept); top-p then sorts the survivors by probability, ascending, and drops each token whose
cumulative probability is <= 1 - p, never the most likely one.

Shapes: (..., V), any leading dimensions; V the vocabulary.
"""

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Truncation:
    """The sampler's filters, as the rollout samples with them."""

    top_k: int = -1  # -1: no top-k filter
    top_p: float = 1.0  # 1.0: no top-p filter

    def __post_init__(self) -> None:
        if self.top_k != -1 and self.top_k < 1:
            raise ValueError(f"top_k must be -1 (off) or >= 1, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def active(self) -> bool:
        return self.top_k != -1 or self.top_p < 1.0

    @classmethod
    def from_meta(cls, meta_info: dict) -> "Truncation":
        """The filters a log-prob pass or an update carries in its meta_info (`top_k`, `top_p`)."""
        return cls(top_k=meta_info.get("top_k", -1), top_p=meta_info.get("top_p", 1.0))


def kept_tokens(logits: torch.Tensor, truncation: Truncation) -> torch.Tensor:
    """Bool (..., V): True for the tokens top-k then top-p keep, from `logits` (..., V) already
    divided by the temperature (top-p depends on it; top-k does not)."""
    keep = torch.ones_like(logits, dtype=torch.bool)  # (..., V)
    if truncation.top_k != -1 and truncation.top_k < logits.shape[-1]:
        kth = logits.topk(truncation.top_k, dim=-1).values[..., -1:]  # (..., 1)
        keep = logits >= kth
    if truncation.top_p < 1.0:
        ascending, order = logits.masked_fill(~keep, float("-inf")).sort(dim=-1)  # (..., V) each
        cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)  # (..., V)
        dropped = cumulative <= 1.0 - truncation.top_p  # (..., V), in ascending order
        dropped[..., -1] = False  # the most likely token stays
        keep = keep & ~torch.empty_like(dropped).scatter_(-1, order, dropped)
    return keep


def keep_labels(keep: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """`keep` (..., V) with each position's `labels` (...) kept too. The engine sampled the label
    from its own kept set; where the trainer's logits put it just outside (a token at the boundary,
    other kernels) it stays in the trainer's set, so its log-prob is finite."""
    return keep.scatter(-1, labels.unsqueeze(-1), True)


def truncated_log_softmax(
    logits: torch.Tensor, truncation: Truncation, labels: torch.Tensor | None = None
) -> torch.Tensor:
    """log p (..., V) of the sampling distribution: log_softmax of `logits` (..., V, already divided
    by the temperature) over the kept tokens, -inf elsewhere; `labels` (...), if given, are kept."""
    if not truncation.active:
        return logits.log_softmax(dim=-1)
    keep = kept_tokens(logits, truncation)
    if labels is not None:
        keep = keep_labels(keep, labels)
    return logits.masked_fill(~keep, float("-inf")).log_softmax(dim=-1)
