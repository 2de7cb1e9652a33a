"""Policy losses by name: the registry `actor.update.policy_loss` picks from, and the losses of the
field beyond PPO's clip, each a pure function of (B, R) tensors citing its paper.

Every registered loss (and a user's, named by dotted path) has one signature,
`fn(old_log_prob, log_prob, advantages, response_mask, config, loss_agg_mode, global_token_count,
global_seq_count, is_weights)`: (B, R) log-probs under the policy that sampled (old) and the one
being trained, advantages and the mask of loss tokens; `config` the actor's update settings
(`ActorUpdateConfig`: each loss reads its own knobs from it); the aggregation mode and the whole
mini-batch's counts as `agg_loss` takes them; `is_weights` (B, R) the off-policy correction's
weights, or None. It returns (pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower) as
`compute_policy_loss` does: the statistics are means over this batch's valid tokens, 0 for a loss
that has no such clip.

The losses below are written as (B, R) token losses (`PolicyLossTerms`); the registry weighs them by
`is_weights` and aggregates them with `loss_agg_mode`, as for PPO.
"""

import difflib
from collections.abc import Callable
from typing import NamedTuple

import torch

from hybridflow.algorithms.losses import agg_loss, compute_policy_loss, compute_policy_loss_gspo
from hybridflow.algorithms.masked import masked_mean
from hybridflow.utils.imports import import_by_path, parameter_names

PolicyLossFn = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]
POLICY_LOSS_PARAMETERS = (
    "old_log_prob",
    "log_prob",
    "advantages",
    "response_mask",
    "config",
    "loss_agg_mode",
    "global_token_count",
    "global_seq_count",
    "is_weights",
)
KEY = "actor.update.policy_loss"
# exp of a log-ratio beyond this overflows; every ratio-based loss here clamps there, as PPO's does
MAX_LOG_RATIO = 20.0


class PolicyLossTerms(NamedTuple):
    """A loss's (B, R) token losses and its two clip statistics (scalars)."""

    losses: torch.Tensor  # (B, R), before off-policy weights and aggregation
    clipfrac: torch.Tensor  # share of valid tokens the loss's clip (or mask) acted on
    clipfrac_lower: torch.Tensor  # share of valid tokens its second bound acted on (0 if none)


def _ratio(old_log_prob: torch.Tensor, log_prob: torch.Tensor) -> torch.Tensor:
    """r = pi / pi_old per token, (B, R); the log-ratio clamped against overflow."""
    return torch.exp((log_prob - old_log_prob).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))


def _none(like: torch.Tensor) -> torch.Tensor:
    return torch.zeros((), dtype=like.dtype, device=like.device)


def cispo_losses(old_log_prob, log_prob, advantages, response_mask, clip_ratio_low, clip_ratio_high):
    """CISPO (MiniMax 2025, "MiniMax-M1: Scaling Test-Time Compute Efficiently with Lightning
    Attention", arXiv:2506.13585): REINFORCE with a clipped importance weight that carries no
    gradient, -sg(clip(r, 1 - clip_ratio_low, 1 + clip_ratio_high)) * A * log pi. Unlike PPO's clip,
    no token's gradient is dropped: the weight only bounds it. The paper sets no lower bound (a large
    eps_low) and tunes eps_high. clipfrac: the share of tokens whose weight was clipped."""
    ratio = _ratio(old_log_prob, log_prob).detach()  # (B, R)
    weight = ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    clipfrac = masked_mean((weight != ratio).float(), response_mask)
    return PolicyLossTerms(-weight * advantages * log_prob, clipfrac, _none(clipfrac))


def sapo_losses(old_log_prob, log_prob, advantages, response_mask, tau_pos, tau_neg):
    """SAPO (Gao et al. 2025, "Soft Adaptive Policy Optimization", arXiv:2511.20347): PPO's hard
    clip replaced by a soft gate, -f(r) * A with f(r) = sigmoid(tau * (r - 1)) * 4 / tau, tau =
    tau_pos where A > 0 and tau_neg otherwise. f'(1) = 1: on-policy tokens get the plain policy
    gradient, which decays smoothly as r leaves 1 (faster for the larger tau; the paper uses
    tau_pos 1.0, tau_neg 1.05 and a sequence mean of token means, "seq-mean-token-mean")."""
    ratio = _ratio(old_log_prob, log_prob)  # (B, R)
    tau = torch.where(advantages > 0, tau_pos, tau_neg).to(ratio.dtype)
    gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    zero = _none(ratio)
    return PolicyLossTerms(-gate * advantages, zero, zero)


def gmpo_losses(old_log_prob, log_prob, advantages, response_mask, clip_ratio_low, clip_ratio_high):
    """GMPO (Zhao et al. 2025, "Geometric-Mean Policy Optimization", arXiv:2507.20673): the
    sequence's ratio is the geometric mean of its token ratios, each clipped in log space to
    [-clip_ratio_low, clip_ratio_high] the PPO way (the clip binds only where it lowers the
    objective): loss_i = -A_i * exp(mean_t sgn(A) * min(sgn(A) log r_t, sgn(A) clip(log r_t))).
    The paper clips at +-0.4 and averages over sequences ("seq-mean-token-mean": each valid token
    carries its sequence's loss). One advantage per sequence: the mean of its tokens'."""
    mask = response_mask.to(log_prob.dtype)
    log_ratio = (log_prob - old_log_prob).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)  # (B, R)
    tokens = mask.sum(-1).clamp(min=1)  # (B,)
    advantage = (advantages * mask).sum(-1) / tokens  # (B,)
    sign = torch.sign(advantage).unsqueeze(-1)  # (B, 1)
    clipped = log_ratio.clamp(-clip_ratio_low, clip_ratio_high)
    kept = sign * torch.minimum(sign * log_ratio, sign * clipped)  # (B, R)
    seq_ratio = torch.exp((kept * mask).sum(-1) / tokens)  # (B,)
    losses = (-advantage * seq_ratio).unsqueeze(-1).expand_as(log_prob)  # (B, R)
    clip_active = sign * clipped < sign * log_ratio  # (B, R)
    return PolicyLossTerms(losses, masked_mean(clip_active.float(), response_mask), _none(mask))


def _dppo_losses(old_log_prob, log_prob, advantages, response_mask, inside, clip_ratio_c):
    """DPPO's shared form: -A * sg(min(r, C)) * log pi on the tokens `inside` the trust region, 0
    outside. Its gradient is PPO's -A * grad r (while r < C) masked by the divergence instead of
    the ratio."""
    ratio = _ratio(old_log_prob, log_prob).detach()  # (B, R)
    inside = inside.detach().to(log_prob.dtype)
    losses = -advantages * ratio.clamp(max=clip_ratio_c) * log_prob * inside
    clipfrac = masked_mean(1.0 - inside, response_mask)
    truncated = masked_mean((ratio > clip_ratio_c).to(inside.dtype) * inside, response_mask)
    return PolicyLossTerms(losses, clipfrac, truncated)


def dppo_tv_losses(
    old_log_prob, log_prob, advantages, response_mask, clip_ratio_low, clip_ratio_high, clip_ratio_c
):
    """DPPO-Binary-TV (Qi et al. 2026, "Rethinking the Trust Region in LLM Reinforcement Learning",
    arXiv:2602.04879): PPO's ratio clip replaced by a bound on the total variation between old and
    new policy, estimated on the sampled token's binary distribution: |p - p_old|. A token leaves
    the loss where the update would take it further out: p - p_old > clip_ratio_high for A > 0, or
    p - p_old < -clip_ratio_low for A <= 0. The ratio weight is truncated at clip_ratio_c (the
    paper's TIS; use a large value, e.g. 10000). clipfrac: tokens outside; clipfrac_lower: tokens
    inside whose weight was truncated. verl's DPPO example uses thresholds of 0.15."""
    change = torch.exp(log_prob) - torch.exp(old_log_prob)  # (B, R)
    inside = torch.where(advantages > 0, change <= clip_ratio_high, change >= -clip_ratio_low)
    return _dppo_losses(old_log_prob, log_prob, advantages, response_mask, inside, clip_ratio_c)


def dppo_kl_losses(
    old_log_prob, log_prob, advantages, response_mask, clip_ratio_low, clip_ratio_high, clip_ratio_c
):
    """DPPO-Binary-KL (the paper of `dppo_tv_losses`): the trust region is the KL(old || new) of the
    sampled token's binary distribution, p_old log(p_old / p) + (1 - p_old) log((1 - p_old) / (1 - p)).
    A token leaves the loss where that exceeds clip_ratio_high while p rises with A > 0, or
    clip_ratio_low while p falls with A <= 0; otherwise as DPPO-TV. verl's example: 0.05."""
    prob, old_prob = torch.exp(log_prob), torch.exp(old_log_prob)  # (B, R)
    eps = 1e-8  # p = 1 (a certain token) would give log(0)
    binary_kl = old_prob * (old_log_prob - log_prob) + (1.0 - old_prob) * (
        torch.log(1.0 - old_prob + eps) - torch.log(1.0 - prob + eps)
    )
    inside_positive = (binary_kl <= clip_ratio_high) | (prob <= old_prob)
    inside_negative = (binary_kl <= clip_ratio_low) | (prob >= old_prob)
    inside = torch.where(advantages > 0, inside_positive, inside_negative)
    return _dppo_losses(old_log_prob, log_prob, advantages, response_mask, inside, clip_ratio_c)


def _ppo_clip(old_log_prob, log_prob, advantages, clip_ratio_low, clip_ratio_high):
    """PPO's clipped token losses (B, R) and where the clip is active (B, R), without dual clip."""
    ratio = _ratio(old_log_prob, log_prob)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    return torch.maximum(unclipped, clipped), clipped > unclipped


def token_covariance(advantages: torch.Tensor, log_prob: torch.Tensor, response_mask: torch.Tensor):
    """(A_t - mean A) * (log pi_t - mean log pi) per token (B, R), the means over the valid tokens:
    each token's term of the covariance that drives the entropy change (Cui et al. 2025)."""
    log_prob = log_prob.detach()
    return (advantages - masked_mean(advantages, response_mask)) * (
        log_prob - masked_mean(log_prob, response_mask)
    )


def clip_cov_losses(
    old_log_prob, log_prob, advantages, response_mask, clip_ratio_low, clip_ratio_high, clip_cov_ratio,
    clip_cov_lb, clip_cov_ub, generator: torch.Generator | None = None,
):  # fmt: skip
    """Clip-Cov (Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning for Reasoning
    Language Models", arXiv:2505.22617): PPO's clipped loss, except that
    max(1, int(clip_cov_ratio * N)) tokens, drawn at random among the N valid tokens whose covariance
    term lies in (clip_cov_lb, clip_cov_ub) and that PPO's clip leaves alone, lose their loss and
    gradient. clipfrac: the share of tokens dropped so
    (PPO's own clip is not counted). The draw uses `generator` (torch's default when None)."""
    losses, ppo_clipped = _ppo_clip(old_log_prob, log_prob, advantages, clip_ratio_low, clip_ratio_high)
    cov = token_covariance(advantages, log_prob, response_mask)  # (B, R)
    valid = response_mask.bool()
    candidates = torch.nonzero(valid & ~ppo_clipped & (cov > clip_cov_lb) & (cov < clip_cov_ub))  # (n, 2)
    count = max(int(clip_cov_ratio * int(valid.sum())), 1)
    order = torch.randperm(len(candidates), generator=generator)[:count].to(candidates.device)
    drop = torch.zeros_like(valid)
    drop[candidates[order, 0], candidates[order, 1]] = True
    return PolicyLossTerms(losses * ~drop, masked_mean(drop.float(), response_mask), _none(losses))


def kl_cov_losses(old_log_prob, log_prob, advantages, response_mask, kl_cov_ratio, ppo_kl_coef):
    """KL-Cov (the paper of `clip_cov_losses`): the unclipped surrogate -A * r, plus
    ppo_kl_coef * |log r| on the max(1, int(kl_cov_ratio * N)) valid tokens of largest covariance
    term. clipfrac: the share of tokens penalised."""
    log_ratio = (log_prob - old_log_prob).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)  # (B, R)
    valid = response_mask.bool()
    cov = token_covariance(advantages, log_prob, response_mask).masked_fill(~valid, -torch.inf)
    count = min(max(int(kl_cov_ratio * int(valid.sum())), 1), int(valid.sum()))
    penalised = torch.zeros_like(valid).flatten()
    penalised[torch.topk(cov.flatten(), count).indices] = True
    penalised = penalised.view_as(valid)
    losses = -advantages * torch.exp(log_ratio) + ppo_kl_coef * log_ratio.abs() * penalised
    return PolicyLossTerms(losses, masked_mean(penalised.float(), response_mask), _none(losses))


def reinforce_losses(old_log_prob, log_prob, advantages, response_mask):
    """REINFORCE (Williams 1992, "Simple Statistical Gradient-Following Algorithms for
    Connectionist Reinforcement Learning"): -A * log pi, no ratio and no clip; its gradient is
    -A * grad log pi. On-policy by construction: data from an older policy is not corrected (use
    algorithm.rollout_correction for that)."""
    zero = _none(log_prob)
    return PolicyLossTerms(-advantages * log_prob, zero, zero)


def gpg_losses(old_log_prob, log_prob, advantages, response_mask):
    """GPG (Chu et al. 2025, "GPG: A Simple and Strong Reinforcement Learning Baseline for Model
    Reasoning", arXiv:2504.02546): the policy gradient -A * log pi without ratio, clip or KL,
    on group-relative advantages; the same token loss as `reinforce_losses`."""
    return reinforce_losses(old_log_prob, log_prob, advantages, response_mask)


def dro_losses(old_log_prob, log_prob, advantages, response_mask, dro_beta):
    """DRO (Richemond et al. 2024, "Offline Regularised Reinforcement Learning for Large Language
    Models Alignment", arXiv:2405.19107): the policy term of the squared loss
    (A - beta * log(pi / pi_old))^2 / 2, whose gradient in pi is -(A - beta * log r) * grad log pi:
    -(A * log pi - dro_beta / 2 * (log r)^2), with pi_old as the regularising policy (as verl's
    `dro`). dro_beta must be set (> 0)."""
    log_ratio = log_prob - old_log_prob  # (B, R)
    zero = _none(log_prob)
    return PolicyLossTerms(-(advantages * log_prob - 0.5 * dro_beta * log_ratio.square()), zero, zero)


def registered(token_losses: Callable[..., PolicyLossTerms], *knobs: str) -> PolicyLossFn:
    """A registry entry of the common signature from a token-loss function and the names of the
    `config` fields it takes after the four tensors, in order."""

    def policy_loss(
        old_log_prob, log_prob, advantages, response_mask, config, loss_agg_mode, global_token_count,
        global_seq_count, is_weights=None,
    ):  # fmt: skip
        own = (getattr(config, knob) for knob in knobs)
        terms = token_losses(old_log_prob, log_prob, advantages, response_mask, *own)
        losses = terms.losses if is_weights is None else terms.losses * is_weights  # (B, R)
        pg_loss = agg_loss(losses, response_mask, loss_agg_mode, global_token_count, global_seq_count)
        ppo_kl = masked_mean(old_log_prob - log_prob, response_mask)
        return pg_loss, terms.clipfrac, ppo_kl, terms.clipfrac_lower

    policy_loss.__doc__ = token_losses.__doc__
    return policy_loss


def vanilla(
    old_log_prob, log_prob, advantages, response_mask, config, loss_agg_mode, global_token_count,
    global_seq_count, is_weights=None,
):  # fmt: skip
    """PPO's clipped surrogate with clip-higher and dual clip (`compute_policy_loss`)."""
    return compute_policy_loss(
        old_log_prob, log_prob, advantages, response_mask, config.clip_ratio_low, config.clip_ratio_high,
        config.clip_ratio_c, loss_agg_mode, global_token_count, global_seq_count, is_weights,
    )  # fmt: skip


def gspo(
    old_log_prob, log_prob, advantages, response_mask, config, loss_agg_mode, global_token_count,
    global_seq_count, is_weights=None,
):  # fmt: skip
    """GSPO's sequence-level ratio and clip (`compute_policy_loss_gspo`)."""
    return compute_policy_loss_gspo(
        old_log_prob, log_prob, advantages, response_mask, config.clip_ratio_low, config.clip_ratio_high,
        loss_agg_mode, global_token_count, global_seq_count, is_weights,
    )  # fmt: skip


CLIP = ("clip_ratio_low", "clip_ratio_high")
# name -> (its token losses, the `config` fields they take after the tensors, in order)
TOKEN_LOSSES: dict[str, tuple[Callable[..., PolicyLossTerms], tuple[str, ...]]] = {
    "cispo": (cispo_losses, CLIP),
    "sapo": (sapo_losses, ("tau_pos", "tau_neg")),
    "gmpo": (gmpo_losses, CLIP),
    "dppo_tv": (dppo_tv_losses, (*CLIP, "clip_ratio_c")),
    "dppo_kl": (dppo_kl_losses, (*CLIP, "clip_ratio_c")),
    "clip_cov": (clip_cov_losses, (*CLIP, "clip_cov_ratio", "clip_cov_lb", "clip_cov_ub")),
    "kl_cov": (kl_cov_losses, ("kl_cov_ratio", "ppo_kl_coef")),
    "gpg": (gpg_losses, ()),
    "dro": (dro_losses, ("dro_beta",)),
    "reinforce": (reinforce_losses, ()),
}
POLICY_LOSS_FNS: dict[str, PolicyLossFn] = {
    "vanilla": vanilla,
    "gspo": gspo,
    **{name: registered(fn, *knobs) for name, (fn, knobs) in TOKEN_LOSSES.items()},
}
# the `config` fields each registered loss reads
POLICY_LOSS_KNOBS: dict[str, tuple[str, ...]] = {
    "vanilla": (*CLIP, "clip_ratio_c"),
    "gspo": CLIP,
    **{name: knobs for name, (_, knobs) in TOKEN_LOSSES.items()},
}
POLICY_LOSSES = tuple(POLICY_LOSS_FNS)


def policy_loss_fn(name: str) -> PolicyLossFn:
    """The registered loss `name`, or the function a dotted path `package.module.function` names,
    checked to take POLICY_LOSS_PARAMETERS. ValueError naming the key, the value and the fix."""
    if name in POLICY_LOSS_FNS:
        return POLICY_LOSS_FNS[name]
    if "." not in name and ":" not in name:
        nearest = difflib.get_close_matches(name, POLICY_LOSSES, n=1)
        raise ValueError(
            f"{KEY}={name!r} is neither a registered loss {list(POLICY_LOSSES)} nor a dotted path "
            "'package.module.function' to a loss of your own"
            + (f"; did you mean {nearest[0]!r}?" if nearest else "")
        )
    fn = import_by_path(name, KEY, "package.module.function")
    check_policy_loss_signature(fn, name)
    return fn


def check_policy_loss_signature(fn: object, name: str) -> None:
    """ValueError unless `fn` is callable with POLICY_LOSS_PARAMETERS as its parameters' names."""
    names = parameter_names(fn, name, KEY)
    if names != POLICY_LOSS_PARAMETERS:
        raise ValueError(
            f"{KEY}={name!r}: {getattr(fn, '__name__', fn)} takes {names}; a policy loss must take "
            f"{POLICY_LOSS_PARAMETERS} and return (pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower) "
            "(docs/algorithms.md)"
        )
