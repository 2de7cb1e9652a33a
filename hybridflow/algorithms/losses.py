"""Policy and value losses, and the aggregation of a (B, T) loss matrix into a scalar.

Global normalisation: a mini-batch is usually split into micro-batches (and over
data-parallel ranks). `agg_loss` accepts the token / sequence counts of the whole
mini-batch, so that the per-micro-batch results sum exactly to the loss of the whole
mini-batch, whatever the split.
"""

import torch

from hybridflow.algorithms.masked import masked_mean

LOSS_AGG_MODES = (
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str,
    global_token_count: float | None = None,
    global_seq_count: float | None = None,
) -> torch.Tensor:
    """Aggregate a (B, T) loss matrix over its valid tokens into a scalar.

    - "token-mean": sum of token losses / number of valid tokens (DAPO, Yu et al. 2025).
    - "token-sum": sum of token losses, undivided: the loss (and gradient) grows with the
      mini-batch's token count, so the learning rate must be scaled down to match.
    - "seq-mean-token-sum": per-sequence token sum, averaged over sequences (Dr. GRPO,
      Liu et al. 2025).
    - "seq-mean-token-mean": per-sequence token mean, averaged over sequences (GRPO,
      Shao et al. 2024).
    - "seq-mean-token-sum-norm": per-sequence token sum divided by the constant T (the padded
      response width, i.e. the generation budget), averaged over sequences: Dr. GRPO's
      length-unbiased loss (Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical
      Perspective", eq. 3 and its constant-normaliser implementation).
    Sequences count when they hold at least one valid token. The divisors default to this
    batch's own counts; pass the whole mini-batch's `global_token_count` /
    `global_seq_count` to make micro-batch results add up to the mini-batch loss.
    """
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"loss_agg_mode must be one of {LOSS_AGG_MODES}, got {loss_agg_mode!r}")
    mask = loss_mask.to(loss_mat.dtype)
    token_sums = (loss_mat * mask).sum(dim=-1)  # (B,)
    if loss_agg_mode == "token-sum":
        return token_sums.sum()
    if loss_agg_mode == "token-mean":
        count = mask.sum() if global_token_count is None else global_token_count
        return token_sums.sum() / max(float(count), 1.0)
    tokens_per_seq = mask.sum(dim=-1)  # (B,)
    seq_count = (tokens_per_seq > 0).sum() if global_seq_count is None else global_seq_count
    if loss_agg_mode == "seq-mean-token-mean":
        token_sums = token_sums / tokens_per_seq.clamp(min=1)
    elif loss_agg_mode == "seq-mean-token-sum-norm":
        token_sums = token_sums / loss_mat.size(-1)
    return token_sums.sum() / max(float(seq_count), 1.0)


def compute_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
    global_token_count: float | None = None,
    global_seq_count: float | None = None,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO clipped surrogate (Schulman et al. 2017, "Proximal Policy Optimization
    Algorithms"), with asymmetric clip range [1 - clip_ratio_low, 1 + clip_ratio_high]
    ("clip-higher", DAPO, Yu et al. 2025) and dual clip (Ye et al. 2020, "Mastering Complex
    Control in MOBA Games with Deep Reinforcement Learning"): for negative advantages the
    loss is bounded by -A * clip_ratio_c.

    Inputs are (B, R). Returns (pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower): the
    aggregated loss, the fraction of tokens the ratio clip was active on, the mean
    approximate KL(old || new), and the fraction the dual clip was active on. The three
    statistics are means over this batch's valid tokens. `is_weights` (B, R), when given, multiply
    each token's loss: an off-policy correction (hybridflow/algorithms/offpolicy.py).
    """
    if clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be greater than 1.0 (dual clip bound), got {clip_ratio_c}")
    log_ratio = log_prob - old_log_prob  # (B, R)
    # exp of a very large log-ratio overflows; the clip makes the gradient zero there anyway
    ratio = torch.exp(log_ratio.clamp(-20.0, 20.0))
    ppo_kl = masked_mean(-log_ratio, response_mask)

    unclipped = -advantages * ratio  # (B, R)
    clipped = -advantages * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    clip_loss = torch.maximum(unclipped, clipped)
    pg_clipfrac = masked_mean((clipped > unclipped).float(), response_mask)

    dual_bound = -advantages * clip_ratio_c  # (B, R)
    dual_loss = torch.minimum(clip_loss, dual_bound)
    negative = advantages < 0
    pg_clipfrac_lower = masked_mean(((clip_loss > dual_bound) & negative).float(), response_mask)

    pg_losses = torch.where(negative, dual_loss, clip_loss)  # (B, R)
    if is_weights is not None:
        pg_losses = pg_losses * is_weights
    pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode, global_token_count, global_seq_count)
    return pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower


def compute_policy_loss_gspo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio_low: float = 3e-4,
    clip_ratio_high: float = 4e-4,
    loss_agg_mode: str = "seq-mean-token-mean",
    global_token_count: float | None = None,
    global_seq_count: float | None = None,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization", arXiv:2507.18071): the
    importance ratio is the sequence's length-normalised likelihood ratio
    s_i = exp(mean_t(log pi - log pi_old)), clipped to [1 - clip_ratio_low, 1 + clip_ratio_high]
    (the paper uses 3e-4 / 4e-4) as a whole sequence.

    Written as GSPO-token (eq. 13): s_i,t = sg[s_i] * pi(y_t) / sg[pi(y_t)] equals s_i in value, and
    with one advantage per sequence its gradient averaged over the tokens is GSPO's. The paper's
    objective is the sequence mean, "seq-mean-token-mean". Inputs (B, R); returns the same
    four values as `compute_policy_loss` (no dual clip: the last one is 0); `is_weights` as there.
    """
    mask = response_mask.to(log_prob.dtype)
    log_ratio = log_prob - old_log_prob  # (B, R)
    seq_log_ratio = (log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1)  # (B,)
    token_log_ratio = seq_log_ratio.detach().unsqueeze(-1) + log_prob - log_prob.detach()  # (B, R)
    ratio = torch.exp(token_log_ratio.clamp(-20.0, 20.0))  # the same overflow guard as PPO's
    unclipped = -advantages * ratio  # (B, R)
    clipped = -advantages * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    pg_losses = torch.maximum(unclipped, clipped)  # (B, R)
    if is_weights is not None:
        pg_losses = pg_losses * is_weights
    pg_clipfrac = masked_mean((clipped > unclipped).float(), response_mask)
    ppo_kl = masked_mean(-log_ratio, response_mask)
    pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode, global_token_count, global_seq_count)
    return pg_loss, pg_clipfrac, ppo_kl, torch.zeros_like(pg_clipfrac)


def compute_value_loss(
    vpreds: torch.Tensor,
    values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
    global_token_count: float | None = None,
    global_seq_count: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped value loss (PPO2 baselines; Schulman et al. 2017): 0.5 * max((V - R)^2,
    (clip(V, V_old - c, V_old + c) - R)^2), with V the new predictions `vpreds` and V_old the
    `values` the advantages were computed from. Inputs (B, R); returns (vf_loss,
    vf_clipfrac), the latter the fraction of valid tokens where the clipped term is larger.
    """
    vpred_clipped = torch.clamp(vpreds, values - cliprange_value, values + cliprange_value)  # (B, R)
    unclipped = (vpreds - returns) ** 2
    clipped = (vpred_clipped - returns) ** 2
    vf_losses = torch.maximum(unclipped, clipped)  # (B, R)
    vf_loss = 0.5 * agg_loss(vf_losses, response_mask, loss_agg_mode, global_token_count, global_seq_count)
    vf_clipfrac = masked_mean((clipped > unclipped).float(), response_mask)
    return vf_loss, vf_clipfrac
