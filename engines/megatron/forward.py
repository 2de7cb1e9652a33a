"""Forward (and backward) over micro-batches with Megatron-Core's schedules; vocab-parallel log-probs.

`run_micro_batches` drives `get_forward_backward_func()`: the no-pipelining schedule at PP=1 and
the 1F1B pipeline schedule at PP>1 (p2p tensors of shape (T, micro_batch_size, hidden), T being
the padded sequence length of the batch). Two kinds of micro-batches:
- padded: `micro_batches` is an int, that many consecutive (B, T) rows per micro-batch;
- packed: `micro_batches` is a list of row-index groups (e.g. from `token_budget_groups`), each
  run as one THD row of its real tokens with `PackedSeqParams` (see packing.py); under PP every
  micro-batch is padded to the longest one (micro_batch_size 1, seq_length T_pack).
Image prompts (a LLaVA model, vlm.py; `non_tensor_batch["pixel_values"]`) run padded only: each
micro-batch takes its rows' images, and its logits are the (b, T) positions of its rows.

Loss-function contract (used by the actor and critic):
    loss_fn(output, micro_batch) -> (loss, metrics)
- `output`: what the last pipeline stage's GPTModel returns for the micro-batch: logits
  (b, T, Vp / tp) sharded over the tensor-parallel group (padded vocabulary; mask it with
  `vocab_size=` in the functions below), or values (b, T, 1) for a value-head model. Position t
  predicts token t + 1. Only called on the last pipeline stage. Packed micro-batches give a
  `PackedOutput` instead; `ResponseTokens` / `last_token_outputs` read either kind.
- `micro_batch`: the TensorDict slice of `data.batch` for these b rows (every key of the batch).
- returns `loss`, a scalar tensor, and `metrics`, any object (typically a dict of tensors).
  Megatron's schedule (the 2-tuple form of `forward_step_calc_loss`) divides `loss` by the number
  of micro-batches before backward, so a loss that is a mean over its micro-batch gives gradients
  of the mean over the whole batch (with equal-size micro-batches); losses normalised by the
  whole batch's counts and multiplied back (training.py) are exact for any split. It modifies
  `loss` in place: return a fresh tensor. With forward_only=True `loss` is ignored (return e.g. a zero).
`run_micro_batches` returns the list of `metrics`, one per micro-batch, on the last pipeline
stage and an empty list on the others. Gradients land in the DDP buffers (`param.main_grad`) and
are averaged over data-parallel ranks (DDP pre-scales by 1/dp, then sums) by the schedule's
finalize hook, which also sums the two copies of tied embeddings under PP (see model.py).

Positions and RoPE: Megatron applies rotary embeddings at positions 0..T-1 and ignores
`position_ids` for RoPE. Rows here are left-padded prompt + right-padded response, so each row's
real tokens are contiguous, and RoPE attention scores depend only on relative offsets: the result
equals using `position_ids` (checked against transformers in the parity test).
"""

from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist

from engines.megatron import cpu_compat, packing, routing_replay, vlm
from engines.megatron.model import unwrap_model
from hybridflow.algorithms.sampling import Truncation, keep_labels, kept_tokens
from hybridflow.protocol import PIXEL_VALUES_KEY


def build_attention_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """(b, T) 1/0 padding mask -> (b, 1, T, T) bool, True where query t may NOT attend to key s.

    Allowed: causal (s <= t) and key s is a real token.
    """
    seq = attention_mask.shape[1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=attention_mask.device).tril()  # (T, T)
    allowed = causal[None] & attention_mask.bool()[:, None, :]  # (b, T, T)
    return ~allowed[:, None]  # (b, 1, T, T)


def moe_padding_mask(model, attention_mask: torch.Tensor) -> torch.Tensor | None:
    """(b, T) bool, True on padding, for an MoE model's routers (None for a dense one): Megatron-Core
    leaves those positions out of the load-balancing loss (its token counts and mean probabilities,
    `compute_routing_scores_for_aux_loss` in megatron/core/transformer/moe/moe_utils.py), so the
    loss is the one of the real tokens alone, whatever experts padding is routed (or replayed) to."""
    return ~attention_mask.bool() if unwrap_model(model).config.num_moe_experts else None


def _forward_step(loss_fn, device, data_iterator, model):
    micro_batch = next(data_iterator).to(device)
    if routing_replay.replays_routes(model):
        routing_replay.replay_routes(model, micro_batch)  # R3: the rollout's experts, when it has them
    output = model(
        input_ids=micro_batch["input_ids"],
        position_ids=micro_batch["position_ids"],
        attention_mask=build_attention_mask(micro_batch["attention_mask"]),
        padding_mask=moe_padding_mask(model, micro_batch["attention_mask"]),
    )
    if routing_replay.replays_routes(model):
        routing_replay.replay_in_backward(model)  # a recompute in backward replays these routes
    return output, partial(loss_fn, micro_batch=micro_batch)


def _image_forward_step(loss_fn, device, data_iterator, model):
    """A LLaVA micro-batch (vlm.py): the processor's ids collapsed to one token per image, the
    model fills in each image's features; logits (b, T, Vp / tp) cut back to the batch's positions."""
    micro_batch, images = next(data_iterator)
    micro_batch = micro_batch.to(device)
    llava = unwrap_model(model)
    ids, mask = micro_batch["input_ids"], micro_batch["attention_mask"]  # (b, T) each
    responses = micro_batch["responses"].shape[1] if "responses" in micro_batch else 0
    slots = vlm.mark_image_slots(ids, llava.vlm_config.image_token_id, ids.shape[1] - responses)  # (b, T)
    features = llava.img_seq_len
    collapsed = vlm.collapse_image_tokens(slots, vlm.IMAGE_SLOT, features)  # (b, T')
    combined_mask = vlm.llava_attention_mask(mask, slots, vlm.IMAGE_SLOT, features)  # (b, T + extra)
    logits, _ = model(
        images=images.to(device, next(llava.parameters()).dtype),
        input_ids=collapsed,
        position_ids=torch.arange(collapsed.shape[1], device=device).expand_as(collapsed),  # unused by RoPE
        attention_mask=build_attention_mask(combined_mask),
    )  # (b, T + extra, Vp / tp)
    return logits[:, : ids.shape[1]], partial(loss_fn, micro_batch=micro_batch)


def _batch_of(data):
    batch = getattr(data, "batch", None)
    if batch is None:
        raise TypeError(f"expected a DataProto with a tensor batch, got {type(data).__name__}")
    missing = [k for k in ("input_ids", "attention_mask", "position_ids") if k not in batch]
    if missing:
        raise ValueError(f"batch lacks keys {missing} needed for the model forward")
    return batch


def run_micro_batches(chunks, data, micro_batches, loss_fn, forward_only: bool) -> list:
    """Run `data` through the model with Megatron's schedule (contract above); `micro_batches` is
    a row count (padded micro-batches) or a list of row-index groups (packed micro-batches)."""
    batch = _batch_of(data)
    pixel_rows = getattr(data, "non_tensor_batch", {}).get(PIXEL_VALUES_KEY)
    if not isinstance(micro_batches, int):
        if pixel_rows is not None:
            raise ValueError(
                "image prompts run in padded micro-batches (packing with image tokens is not built): "
                "leave max_token_len unset for vision-language batches"
            )
        return _run_packed(chunks, batch, micro_batches, loss_fn, forward_only)
    rows, seq_len = batch["input_ids"].shape
    if micro_batches < 1 or rows % micro_batches:
        raise ValueError(
            f"micro_batch_size={micro_batches} must be positive and divide the batch size {rows}"
        )
    split = batch.split(micro_batches)
    if pixel_rows is None:
        return _schedule(chunks, _forward_step, loss_fn, split, seq_len, micro_batches, forward_only)
    with_images = list(zip(split, vlm.micro_batch_images(pixel_rows, micro_batches), strict=True))
    return _schedule(chunks, _image_forward_step, loss_fn, with_images, seq_len, micro_batches, forward_only)


def _schedule(chunks, forward_step, loss_fn, micro_batches, seq_len, micro_batch_size, forward_only):
    from megatron.core.pipeline_parallel import get_forward_backward_func

    device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    schedule = get_forward_backward_func()
    grad = torch.no_grad() if forward_only else torch.enable_grad()
    with grad, cpu_compat.cuda_calls_on_cpu(), routing_replay.replay_pass(chunks):
        return schedule(
            forward_step_func=partial(forward_step, loss_fn, device),
            data_iterator=iter(micro_batches),
            model=list(chunks),
            num_microbatches=len(micro_batches),
            seq_length=seq_len,
            micro_batch_size=micro_batch_size,
            forward_only=forward_only,
        )


@dataclass
class PackedOutput:
    """A packed micro-batch's model output: `tokens` (1, T_pack, X) and the packing maps."""

    tokens: torch.Tensor
    packed: packing.PackedMicroBatch


def _run_packed(chunks, batch, groups: list[list[int]], loss_fn, forward_only: bool) -> list:
    from megatron.core import parallel_state

    config = unwrap_model(chunks[0]).config
    multiple = packing.length_multiple(
        config.tensor_model_parallel_size, config.sequence_parallel, config.context_parallel_size
    )
    lengths = batch["attention_mask"].sum(-1).tolist()
    response_len = batch["responses"].shape[1] if "responses" in batch else 0
    pipelined = parallel_state.get_pipeline_model_parallel_world_size() > 1
    totals = packing.packed_lengths(groups, lengths, multiple, pipelined)
    micro_batches = []
    for group, total in zip(groups, totals, strict=True):
        rows = batch[torch.tensor(group, dtype=torch.long)]
        packed = packing.pack_micro_batch(rows["input_ids"], rows["attention_mask"], response_len, total)
        micro_batches.append((rows, packed))
    return _schedule(chunks, _packed_forward_step, loss_fn, micro_batches, max(totals), 1, forward_only)


def _packed_forward_step(loss_fn, device, data_iterator, model):
    from megatron.core.packed_seq_params import PackedSeqParams

    micro_batch, packed = next(data_iterator)
    micro_batch = micro_batch.to(device)
    params = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=packed.cu_seqlens.to(device),
        cu_seqlens_kv=packed.cu_seqlens.to(device),
        cu_seqlens_q_padded=packed.cu_seqlens_padded.to(device),
        cu_seqlens_kv_padded=packed.cu_seqlens_padded.to(device),
        max_seqlen_q=packed.max_seqlen,
        max_seqlen_kv=packed.max_seqlen,
    )
    output = model(
        input_ids=packed.input_ids.to(device),
        position_ids=packed.position_ids.to(device),
        attention_mask=None,
        packed_seq_params=params,
    )
    return output, partial(_packed_loss, loss_fn, micro_batch, packed)


def _packed_loss(loss_fn, micro_batch, packed, output):
    return loss_fn(PackedOutput(output, packed), micro_batch=micro_batch)


class ResponseTokens:
    """The outputs that predict the response tokens, in either layout, and the way back to (b, R).

    Padded: `outputs` (b, R, X), `select` and `to_rows` are the identity. Packed: `outputs` (n, X)
    for the n real response tokens only (no work on padding), `select` (b, R) -> (n,) picks them
    from a per-row tensor, `to_rows` (n,) -> (b, R) puts results back with zeros on padding.
    """

    def __init__(self, output, micro_batch):
        response_len = micro_batch["responses"].shape[1]
        self.packed = isinstance(output, PackedOutput)
        if self.packed:
            self.mask = micro_batch["attention_mask"][:, -response_len:].bool()  # (b, R), as packed
            index = output.packed.response_index.to(output.tokens.device)
            self.outputs = output.tokens[0, index]  # (n, X)
        else:
            self.outputs = output[:, -response_len - 1 : -1]  # (b, R, X)

    def select(self, per_row: torch.Tensor) -> torch.Tensor:
        return per_row[self.mask] if self.packed else per_row

    def to_rows(self, per_token: torch.Tensor) -> torch.Tensor:
        if not self.packed:
            return per_token
        rows = per_token.new_zeros((*self.mask.shape, *per_token.shape[1:]))  # (b, R, ...)
        return rows.index_put((self.mask,), per_token)


def last_token_outputs(output, attention_mask: torch.Tensor) -> torch.Tensor:
    """(b, X): the output at each row's last real token (the last 1 in its attention mask)."""
    if isinstance(output, PackedOutput):
        return output.tokens[0, output.packed.last_index.to(output.tokens.device)]
    last = attention_mask.shape[1] - 1 - attention_mask.flip(-1).argmax(dim=-1)  # (b,)
    return output[torch.arange(output.shape[0], device=output.device), last]


def token_budget_groups(data, max_token_len: int, key: str) -> list[list[int]]:
    """Packed micro-batches of at most `max_token_len` tokens (prompt + response) each, as many on
    every data-parallel rank (see packing.token_budget_groups)."""
    from megatron.core import parallel_state

    def agree_max(count: int) -> int:
        value = torch.tensor([count], dtype=torch.long)
        if torch.cuda.is_available():  # NCCL reduces device tensors only
            value = value.cuda()
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=parallel_state.get_data_parallel_group())
        return int(value.item())

    lengths = _batch_of(data)["attention_mask"].sum(-1).tolist()
    return packing.token_budget_groups(lengths, max_token_len, key, agree_max)


def _tp_rank_and_size() -> tuple[int, int]:
    from megatron.core import parallel_state

    return (
        parallel_state.get_tensor_model_parallel_rank(),
        parallel_state.get_tensor_model_parallel_world_size(),
    )


def padded_vocab_columns(local_vocab: int, vocab_size: int | None, device) -> torch.Tensor | None:
    """Bool (local_vocab,) marking this TP rank's columns beyond the real vocabulary, or None."""
    rank, _ = _tp_rank_and_size()
    start = rank * local_vocab
    if vocab_size is None or start + local_vocab <= vocab_size:
        return None
    return torch.arange(start, start + local_vocab, device=device) >= vocab_size


def vocab_parallel_log_probs(
    logits: torch.Tensor,
    labels: torch.Tensor,
    vocab_size: int | None = None,
    excluded: torch.Tensor | None = None,
):
    """log softmax(logits)[label] with logits (..., Vp / tp) sharded over the TP group; fp32 (...).

    Never gathers the vocabulary: Megatron's `vocab_parallel_cross_entropy` all-reduces the max,
    the sum of exponentials and the target logit. Columns >= `vocab_size` (padding) get no mass,
    nor do those of `excluded` (..., Vp / tp) when given (`sampling_excluded`: padding included).
    """
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    padded = (
        padded_vocab_columns(logits.shape[-1], vocab_size, logits.device) if excluded is None else excluded
    )
    if padded is None:
        # Megatron's function works in place on fp32 input: hand it a copy.
        fresh = logits.float() if logits.dtype != torch.float32 else logits.clone()
    else:
        fresh = logits.float().masked_fill(padded, float("-inf"))
    return -vocab_parallel_cross_entropy(fresh, labels)


def vocab_parallel_gather_log_probs(
    logits: torch.Tensor,
    ids: torch.Tensor,
    vocab_size: int | None = None,
    excluded: torch.Tensor | None = None,
):
    """log softmax(logits) at `ids` (..., K) with logits (..., Vp / tp) sharded over the TP group;
    fp32 (..., K), no gradient; -inf at `excluded` columns. One normaliser for all K ids: the max
    and the sum of exponentials are all-reduced once, each id's logit comes from the rank holding
    its column."""
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    z = masked_padding(logits.float(), vocab_size, excluded)  # (..., Vp / tp)
    z_max = z.max(dim=-1, keepdim=True).values  # (..., 1)
    dist.all_reduce(z_max, op=dist.ReduceOp.MAX, group=group)
    sum_exp = (z - z_max).exp().sum(dim=-1, keepdim=True)  # (..., 1)
    dist.all_reduce(sum_exp, group=group)
    rank, _ = _tp_rank_and_size()
    local = ids - rank * z.shape[-1]  # (..., K), this rank's column of each id
    mine = (local >= 0) & (local < z.shape[-1])
    picked = z.gather(-1, local.clamp(0, z.shape[-1] - 1)).masked_fill(~mine, 0.0)  # (..., K)
    dist.all_reduce(picked, group=group)
    return picked - z_max - sum_exp.log()


def vocab_parallel_argmax(logits: torch.Tensor, vocab_size: int | None = None) -> torch.Tensor:
    """The most likely token id (...,) with logits (..., Vp / tp) sharded over the TP group; on a
    tie the lowest id, as torch.argmax over the whole vocabulary gives."""
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    z = masked_padding(logits.float(), vocab_size)  # (..., Vp / tp)
    local_max, local_id = z.max(dim=-1)  # (...,) each; the first maximum
    best = local_max.clone()
    dist.all_reduce(best, op=dist.ReduceOp.MAX, group=group)
    rank, _ = _tp_rank_and_size()
    beyond = torch.iinfo(torch.long).max  # a rank without the maximum offers no id
    ids = torch.where(local_max == best, local_id + rank * z.shape[-1], beyond)
    dist.all_reduce(ids, op=dist.ReduceOp.MIN, group=group)
    return ids


def masked_padding(
    z: torch.Tensor, vocab_size: int | None, excluded: torch.Tensor | None = None
) -> torch.Tensor:
    """`z` (..., Vp / tp) with this rank's padded vocabulary columns at -inf, or with the columns of
    `excluded` (..., Vp / tp) when given (`sampling_excluded`, padding included)."""
    padded = padded_vocab_columns(z.shape[-1], vocab_size, z.device) if excluded is None else excluded
    return z if padded is None else z.masked_fill(padded, float("-inf"))


class _VocabParallelEntropy(torch.autograd.Function):
    """H = -sum_v p_v log p_v over a TP-sharded vocabulary, with the analytic gradient
    dH/dz_v = -p_v (log p_v + H), which each rank computes for its own columns.

    Autograd through all-reduced sums would miss the other ranks' terms in dH/dS (S, the
    global sum of exponentials, enters every rank's probabilities), hence a custom backward.
    """

    @staticmethod
    def forward(ctx, z, padded):
        from megatron.core import parallel_state

        group = parallel_state.get_tensor_model_parallel_group()
        if padded is not None:
            z = z.masked_fill(padded, float("-inf"))
        z_max = z.max(dim=-1, keepdim=True).values  # (..., 1)
        dist.all_reduce(z_max, op=dist.ReduceOp.MAX, group=group)
        shifted = z - z_max  # (..., Vp / tp), -inf on padding
        sum_exp = shifted.exp().sum(dim=-1, keepdim=True)  # (..., 1)
        dist.all_reduce(sum_exp, group=group)
        log_p = shifted - sum_exp.log()
        if padded is not None:
            log_p = log_p.masked_fill(padded, 0.0)  # p = 0 there; 0 * -inf would be NaN
        p = log_p.exp() if padded is None else log_p.exp().masked_fill(padded, 0.0)
        entropy = -(p * log_p).sum(dim=-1)  # (...)
        dist.all_reduce(entropy, group=group)
        ctx.save_for_backward(p, log_p, entropy)
        return entropy

    @staticmethod
    def backward(ctx, grad_entropy):
        p, log_p, entropy = ctx.saved_tensors
        grad_z = -grad_entropy.unsqueeze(-1) * p * (log_p + entropy.unsqueeze(-1))
        return grad_z, None


def vocab_parallel_entropy(
    logits: torch.Tensor, vocab_size: int | None = None, excluded: torch.Tensor | None = None
) -> torch.Tensor:
    """Entropy of softmax(logits) with logits (..., Vp / tp) sharded over the TP group; fp32 (...).

    Never gathers the vocabulary: the max, the sum of exponentials and the entropy terms are
    all-reduced over the TP group; gradients are exact on every rank (see `_VocabParallelEntropy`).
    Padded columns (>= `vocab_size`) are excluded, or the columns of `excluded` (..., Vp / tp) when
    given (`sampling_excluded`, padding included).
    """
    z = logits.float()
    padded = padded_vocab_columns(z.shape[-1], vocab_size, z.device) if excluded is None else excluded
    return _VocabParallelEntropy.apply(z, padded)


def vocab_parallel_sum_squares(
    logits: torch.Tensor, vocab_size: int | None = None, excluded: torch.Tensor | None = None
) -> torch.Tensor:
    """sum_v p_v^2 of p = softmax(logits) with logits (..., Vp / tp) sharded over the TP group; fp32
    (...), no gradient. Never gathers the vocabulary: with s = z - max z (max all-reduced),
    sum p^2 = sum exp(2 s) / (sum exp(s))^2, both sums all-reduced in one call. Padded columns
    (>= `vocab_size`) get no mass, nor those of `excluded` (..., Vp / tp) when given."""
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    with torch.no_grad():
        z = masked_padding(logits.float(), vocab_size, excluded)  # (..., Vp / tp)
        z_max = z.max(dim=-1, keepdim=True).values  # (..., 1)
        dist.all_reduce(z_max, op=dist.ReduceOp.MAX, group=group)
        shifted = z - z_max  # (..., Vp / tp), -inf where excluded
        sums = torch.stack([shifted.exp().sum(dim=-1), (2 * shifted).exp().sum(dim=-1)])  # (2, ...)
        dist.all_reduce(sums, group=group)
        return sums[1] / sums[0] ** 2


def _gather_vocabulary(z: torch.Tensor) -> torch.Tensor:
    """(..., Vp / tp) sharded over the TP group -> (..., Vp) on every rank; no gradient."""
    from megatron.core import parallel_state

    _, size = _tp_rank_and_size()
    if size == 1:
        return z
    shards = [torch.empty_like(z) for _ in range(size)]
    dist.all_gather(shards, z.contiguous(), group=parallel_state.get_tensor_model_parallel_group())
    return torch.cat(shards, dim=-1)


def sampling_excluded(
    scaled: torch.Tensor, labels: torch.Tensor, truncation: Truncation | None, vocab_size: int | None
) -> torch.Tensor | None:
    """Bool (..., Vp / tp): this rank's columns outside the distribution the rollout sampled from,
    given `scaled` logits (..., Vp / tp, divided by the temperature) and the sampled `labels` (...):
    padding, and with `truncation` the tokens its top-k / top-p drop (the labels always kept,
    hybridflow/algorithms/sampling.py). None when no column is excluded.

    The kept set is a property of the whole vocabulary, so under TP every rank gathers the scaled
    logits (..., Vp) once, without gradient: the set is a constant of the loss, as it is of the
    sampler."""
    padded = padded_vocab_columns(scaled.shape[-1], vocab_size, scaled.device)
    if truncation is None or not truncation.active:
        return padded
    with torch.no_grad():
        full = _gather_vocabulary(masked_padding(scaled.detach().float(), vocab_size))  # (..., Vp)
        keep = keep_labels(kept_tokens(full, truncation), labels)  # (..., Vp)
        rank, width = _tp_rank_and_size()[0], scaled.shape[-1]
        excluded = ~keep[..., rank * width : (rank + 1) * width]  # (..., Vp / tp)
    return excluded if padded is None else excluded | padded


def sampled_logits(logits, micro_batch, temperature: float, vocab_size: int | None, truncation):
    """The response positions' logits as the rollout sampled from them: (view, scaled, labels,
    excluded), `scaled` (b, R, Vp / tp) or packed (n, Vp / tp) divided by `temperature`, the sampled
    `labels` (b, R) or (n,), and the columns `truncation` and padding leave out (`sampling_excluded`)."""
    view = ResponseTokens(logits, micro_batch)
    scaled = view.outputs / temperature  # (b, R, Vp / tp) or (n, Vp / tp)
    labels = view.select(micro_batch["responses"])  # (b, R) or (n,)
    return view, scaled, labels, sampling_excluded(scaled, labels, truncation, vocab_size)


def response_log_probs(
    logits,
    micro_batch,
    temperature: float,
    vocab_size: int | None,
    entropy: str,
    truncation: Truncation | None = None,
):
    """Log-probs of `responses` (b, R) and, unless `entropy` is "none", entropies (b, R) (with
    gradients for "grad", without for "detached"), from padded or packed logits: of softmax(logits
    / temperature), renormalised over the tokens the rollout's top-k / top-p keep with `truncation`
    (the distribution the engine sampled from, docs/sampling.md)."""
    view, scaled, labels, excluded = sampled_logits(logits, micro_batch, temperature, vocab_size, truncation)
    log_probs = view.to_rows(vocab_parallel_log_probs(scaled, labels, vocab_size, excluded))
    if entropy == "none":
        return log_probs, None
    with torch.set_grad_enabled(entropy == "grad" and torch.is_grad_enabled()):
        entropies = view.to_rows(vocab_parallel_entropy(scaled, vocab_size, excluded))
    return log_probs, entropies


def response_sum_pi_squared(
    logits, micro_batch, temperature: float, vocab_size: int | None, truncation: Truncation | None = None
) -> torch.Tensor:
    """sum_v pi_v^2 (b, R), no gradient, of the distribution `response_log_probs` takes the log-probs
    of (softmax(logits / temperature) over the tokens `truncation` keeps), from padded or packed logits:
    with pi_y the sampled token's probability, 1 - 2 pi_y + sum pi^2 is the squared norm of the
    log-prob's gradient in the logits (the optimal token baseline's weight,
    hybridflow/algorithms/advantages.py)."""
    view, scaled, _, excluded = sampled_logits(logits, micro_batch, temperature, vocab_size, truncation)
    return view.to_rows(vocab_parallel_sum_squares(scaled, vocab_size, excluded))


def engine_top_k_view(
    logits, micro_batch, temperature: float, vocab_size: int | None, truncation=None
) -> dict:
    """For the full-distribution mismatch check: the actor's log-probs (b, R, K) of the engine's
    top-K ids `rollout_top_k_ids` (b, R, K) (in the distribution `response_log_probs` gives:
    -inf for a token `truncation` drops) and its own most likely ids (b, R), at `temperature`."""
    view, scaled, _, excluded = sampled_logits(logits, micro_batch, temperature, vocab_size, truncation)
    ids = view.select(micro_batch[ENGINE_TOP_K_IDS])  # (b, R, K) or (n, K)
    return {
        "top_k_log_probs": view.to_rows(vocab_parallel_gather_log_probs(scaled, ids, vocab_size, excluded)),
        "top1_ids": view.to_rows(vocab_parallel_argmax(scaled, vocab_size)),
    }


def _log_prob_loss(
    temperature, truncation, vocab_size, calculate_entropy, engine_top_k, sum_pi_squared, logits, micro_batch
):
    log_probs, entropies = response_log_probs(
        logits, micro_batch, temperature, vocab_size, "detached" if calculate_entropy else "none", truncation
    )  # (b, R) each; logits predict the responses
    metrics = {"log_probs": log_probs}
    if calculate_entropy:
        metrics["entropys"] = entropies
    if sum_pi_squared:  # the optimal token baseline's
        squares = response_sum_pi_squared(logits, micro_batch, temperature, vocab_size, truncation)  # (b, R)
        metrics["sum_pi_squared"] = squares
    if engine_top_k and ENGINE_TOP_K_IDS in micro_batch:  # rollout.top_k_log_probs
        metrics |= engine_top_k_view(logits, micro_batch, temperature, vocab_size, truncation)
    return log_probs.new_zeros(()), metrics


ENGINE_TOP_K_IDS = "rollout_top_k_ids"  # (B, R, K) the engine's most likely ids (rollout.top_k_log_probs)
# the log-prob pass's per-micro-batch results -> the output's batch keys
LOG_PROB_OUTPUTS = {
    "log_probs": "old_log_probs",  # (B, R)
    "entropys": "entropys",  # (B, R)
    "top_k_log_probs": "actor_top_k_log_probs",  # (B, R, K) log pi of the engine's top-K ids
    "top1_ids": "actor_top1_ids",  # (B, R) the actor's most likely id
    "sum_pi_squared": "sum_pi_squared",  # (B, R) sum_v pi_v^2, for the optimal token baseline
}


def compute_log_prob(
    chunks,
    data,
    micro_batch_size: int,
    temperature: float = 1.0,
    calculate_entropy: bool = True,
    max_token_len: int | None = None,
    engine_top_k: bool = False,
    truncation: Truncation | None = None,
    sum_pi_squared: bool = False,
):
    """Log-probs (and entropies) of `responses` under the model: DataProto with `old_log_probs`
    (B, R) and `entropys` (B, R), fp32, on the last pipeline stage; None on the other stages.
    At `temperature`, over the tokens `truncation` (the rollout's top-k / top-p) keeps.
    With `engine_top_k` and the engine's top-K ids in the batch (`rollout_top_k_ids`, B, R, K),
    also `actor_top_k_log_probs` (B, R, K) and `actor_top1_ids` (B, R) (LOG_PROB_OUTPUTS); with
    `sum_pi_squared`, `sum_pi_squared` (B, R), sum_v pi_v^2 of the same distribution.

    Logits at positions P-1 .. P+R-2 predict the R response tokens. With `max_token_len`, rows
    run packed in micro-batches of at most that many tokens (padded response positions get 0);
    else in padded micro-batches of `micro_batch_size` rows (padded positions get values too).
    Mask them with `response_mask`.
    """
    from megatron.core import parallel_state

    from hybridflow.protocol import DataProto

    batch = _batch_of(data)
    if "responses" not in batch:
        raise ValueError("compute_log_prob needs 'responses' (B, R) in the batch")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    vocab_size = unwrap_model(chunks[0]).hf_config.vocab_size
    loss_fn = partial(
        _log_prob_loss, temperature, truncation, vocab_size, calculate_entropy, engine_top_k, sum_pi_squared
    )
    groups = None
    if max_token_len is not None:
        groups = token_budget_groups(data, max_token_len, "log-prob max_token_len")
    results = run_micro_batches(
        chunks, data, micro_batch_size if groups is None else groups, loss_fn, forward_only=True
    )
    if not parallel_state.is_pipeline_last_stage():
        return None
    names = {key: name for key, name in LOG_PROB_OUTPUTS.items() if key in results[0]}
    columns = {k: [r[k] for r in results] for k in names}
    if groups is None:
        merged = {k: torch.cat(v) for k, v in columns.items()}
    else:
        merged = {k: packing.restore_order(v, groups) for k, v in columns.items()}
    return DataProto.from_dict(tensors={name: merged[key].cpu() for key, name in names.items()})
