"""The policy on Megatron-Core: log-probs for rollouts, the PPO update, a supervised warm start.

`MegatronActor(chunks, optimizer, scheduler, update_cfg, correction)` wraps this rank's model chunks (from
`build_model`) and, for a trainable actor, the pair from `build_optimizer`; a frozen reference
policy is a `MegatronActor` without optimizer. Every method is collective over the job's ranks
and receives this data-parallel rank's shard of the batch. Results (DataProto, metrics) are
complete on the last pipeline stage; other stages return None or only grad_norm / lr.

Batch keys (B, P+R) input_ids, attention_mask, position_ids; (B, R) responses, response_mask,
old_log_probs, advantages, ref_log_prob (KL loss only), rollout_log_probs (off-policy correction;
when present the rollout-vs-actor mismatch is reported either way); (B, P+R, L, k) routed_experts
when the rollout recorded them, replayed by the routers (routing_replay.py; not by the reference).
Loss normalisation over micro-batches and data-parallel ranks: see training.py.
"""

from functools import partial

from engines.megatron import forward, moe
from engines.megatron.checks import validate_actor_update_config
from engines.megatron.config import ActorUpdateConfig
from engines.megatron.model import unwrap_model
from engines.megatron.routing_replay import AGREEMENT, ROUTES_KEY, replays_routes
from engines.megatron.training import (
    global_counts,
    loss_scale,
    require_keys,
    require_optimizer,
    train_step,
    update_epochs,
)
from hybridflow.algorithms import agg_loss, kl_penalty, policy_loss_fn
from hybridflow.algorithms.offpolicy import rollout_mismatch_kl
from hybridflow.algorithms.rollout_correction import (
    RolloutCorrectionConfig,
    active_parts,
    rollout_correction_weights,
    validate_rollout_correction,
)
from hybridflow.algorithms.sampling import Truncation
from hybridflow.protocol import DataProto

MODEL_KEYS = ("input_ids", "attention_mask", "position_ids", "responses", "response_mask")
POLICY_KEYS = (*MODEL_KEYS, "old_log_probs", "advantages")


def off_policy_correction(data: DataProto, cfg: RolloutCorrectionConfig) -> dict[str, list[float]]:
    """Adds the correction's `is_weights` (B, R) to `data` and returns their statistics over this
    data-parallel rank's rows, plus the rollout-vs-actor log-prob mismatch whenever the batch
    carries rollout_log_probs."""
    if "rollout_log_probs" not in data.batch:
        return {}
    old, rollout, mask = (data.batch[key] for key in ("old_log_probs", "rollout_log_probs", "response_mask"))
    weights, metrics = rollout_correction_weights(cfg, old, rollout, mask)  # (B, R) or None
    if weights is not None:
        data.batch["is_weights"] = weights
    metrics["rollout_actor_kl"] = rollout_mismatch_kl(old, rollout, mask)
    return {key: [value] for key, value in metrics.items()}


class MegatronActor:
    def __init__(
        self,
        chunks,
        optimizer=None,
        scheduler=None,
        update_cfg: ActorUpdateConfig | None = None,
        correction: RolloutCorrectionConfig | None = None,
    ):
        """`correction`: the recipe's algorithm.rollout_correction (None: no correction)."""
        self.chunks = chunks
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.cfg = update_cfg or ActorUpdateConfig()
        self.correction = correction or RolloutCorrectionConfig()
        validate_actor_update_config(self.cfg)
        validate_rollout_correction(self.correction)
        self.policy_loss_fn = policy_loss_fn(self.cfg.policy_loss)  # registered, or a user's by path
        self.vocab_size = unwrap_model(chunks[0]).hf_config.vocab_size

    # ------------------------------------------------------------------ inference
    def compute_log_prob(
        self,
        data: DataProto,
        calculate_entropy: bool = True,
        engine_top_k: bool = False,
        sum_pi_squared: bool = False,
    ) -> DataProto | None:
        """`old_log_probs` (and `entropys`) (B, R) under the current weights; meta_info may set
        `micro_batch_size`, `temperature`, the rollout's `top_k` and `top_p` (log-probs of the
        distribution it sampled from, docs/sampling.md) and `max_token_len` (packed micro-batches
        of at most that many tokens; None or absent: padded micro-batches). With routing replay,
        the output's meta_info["metrics"] has `mismatch/router_agreement` (routing_replay.py); with
        `engine_top_k`, the actor's view of the engine's top-K ids (forward.compute_log_prob); with
        `sum_pi_squared`, `sum_pi_squared` (B, R), sum_v pi_v^2 of the same distribution (the optimal
        token baseline's; off by default, as it costs a pass over the vocabulary)."""
        require_keys(data, MODEL_KEYS[:4], "compute_log_prob")
        for chunk in self.chunks:
            chunk.eval()
        with AGREEMENT.counting():
            out = forward.compute_log_prob(
                self.chunks,
                data,
                data.meta_info.get("micro_batch_size", self.cfg.ppo_micro_batch_size),
                temperature=data.meta_info.get("temperature", 1.0),
                calculate_entropy=calculate_entropy,
                max_token_len=data.meta_info.get("max_token_len"),
                engine_top_k=engine_top_k,
                truncation=Truncation.from_meta(data.meta_info),
                sum_pi_squared=sum_pi_squared,
            )
        if ROUTES_KEY in data.batch and replays_routes(self.chunks[0]):  # every rank: a collective
            agreement = AGREEMENT.share()
            if out is not None:  # the last pipeline stage
                out.meta_info["metrics"] = {"mismatch/router_agreement": [agreement]}
        return out

    def compute_ref_log_prob(self, data: DataProto) -> DataProto | None:
        """The same log-probs under the reference weights, as `ref_log_prob` (B, R). The reference
        routes with its own routers: the rollout's experts (routing replay) are the policy's."""
        if ROUTES_KEY in data.batch:
            keep = [key for key in data.batch.keys() if key != ROUTES_KEY]  # noqa: SIM118 (iteration gives rows)
            data = data.select(batch_keys=keep)
        out = self.compute_log_prob(data, calculate_entropy=False)
        return None if out is None else out.rename("old_log_probs", "ref_log_prob")

    # ------------------------------------------------------------------ PPO
    def update_policy(self, data: DataProto) -> dict[str, list[float]]:
        """PPO epochs over mini-batches, one optimizer step each; metrics hold one value per step."""
        require_optimizer(self.optimizer, self.scheduler, "update_policy")
        cfg = self.cfg
        keys = [*POLICY_KEYS, "ref_log_prob"] if cfg.use_kl_loss else list(POLICY_KEYS)
        if active_parts(self.correction):
            keys.append("rollout_log_probs")  # needs rollout.calculate_log_probs
        require_keys(data, keys, "update_policy")
        temperature = data.meta_info.get("temperature", 1.0)
        if temperature <= 0:
            raise ValueError(f"meta_info temperature must be > 0, got {temperature}")
        moe.clear_aux_loss()
        if "rollout_log_probs" in data.batch and "rollout_log_probs" not in keys:
            keys.append("rollout_log_probs")  # for the mismatch metric
        if ROUTES_KEY in data.batch:
            keys.append(ROUTES_KEY)  # routing replay: the rollout's experts in the update's forwards
        batch = data.select(batch_keys=keys)
        off_policy_metrics = off_policy_correction(batch, self.correction)
        metrics, num_micro_batches = update_epochs(
            self.chunks,
            self.optimizer,
            self.scheduler,
            batch,
            cfg,
            "actor",
            partial(self._policy_loss, temperature, Truncation.from_meta(data.meta_info)),
            shuffle=cfg.shuffle,
            seed=cfg.seed,
        )
        # The router's load-balancing loss (MoE models): Megatron adds it to the gradients itself.
        aux_loss = moe.mean_aux_loss(num_micro_batches)
        if aux_loss is not None:
            metrics["moe_aux_loss"] = [aux_loss]
        return metrics | off_policy_metrics

    def _policy_loss(self, temperature, truncation, counts, scale, logits, micro_batch):
        cfg, mask = self.cfg, micro_batch["response_mask"]
        tokens, seqs = counts
        entropy_grad = "grad" if cfg.entropy_coeff != 0 else "detached"
        log_prob, entropy_tokens = forward.response_log_probs(
            logits, micro_batch, temperature, self.vocab_size, entropy_grad, truncation
        )  # (b, R) each, of the distribution the rollout sampled from
        is_weights = micro_batch.get("is_weights", None)  # (b, R): the off-policy correction's
        pg_loss, clipfrac, ppo_kl, clipfrac_lower = self.policy_loss_fn(
            micro_batch["old_log_probs"], log_prob, micro_batch["advantages"], mask, cfg, cfg.loss_agg_mode,
            tokens, seqs, is_weights,
        )  # fmt: skip
        entropy = agg_loss(entropy_tokens, mask, cfg.loss_agg_mode, tokens, seqs)
        loss = pg_loss - cfg.entropy_coeff * entropy
        share = mask.sum() / tokens  # this micro-batch's share of the mini-batch's tokens
        metrics = {
            "pg_loss": pg_loss.detach(),
            "pg_clipfrac": clipfrac * share,
            "ppo_kl": ppo_kl * share,
            "pg_clipfrac_lower": clipfrac_lower * share,
            "entropy": entropy.detach(),
        }
        if cfg.use_kl_loss:
            kl = kl_penalty(log_prob, micro_batch["ref_log_prob"], cfg.kl_loss_type)  # (b, R)
            kl_loss = agg_loss(kl, mask, cfg.loss_agg_mode, tokens, seqs)
            loss = loss + cfg.kl_loss_coef * kl_loss
            metrics["kl_loss"] = kl_loss.detach()
        return loss * scale, metrics

    # ------------------------------------------------------------------ SFT
    def update_sft(self, data: DataProto) -> dict[str, float]:
        """One optimizer step of token-mean cross-entropy on the response tokens of the whole batch."""
        require_optimizer(self.optimizer, self.scheduler, "update_sft")
        require_keys(data, MODEL_KEYS, "update_sft")
        micro = data.meta_info.get("micro_batch_size", self.cfg.ppo_micro_batch_size)
        if micro < 1 or len(data) % micro:
            raise ValueError(
                f"micro_batch_size={micro} must be positive and divide this rank's {len(data)} rows"
            )
        data = data.select(batch_keys=list(MODEL_KEYS))
        counts = global_counts(data.batch["response_mask"])
        loss_fn = partial(self._sft_loss, counts[0], loss_scale(len(data) // micro))
        return train_step(
            self.chunks, self.optimizer, self.scheduler, data, micro, loss_fn, self.cfg.max_update_ratio
        )

    def _sft_loss(self, tokens, scale, logits, micro_batch):
        mask = micro_batch["response_mask"]
        log_prob, _ = forward.response_log_probs(logits, micro_batch, 1.0, self.vocab_size, "none")  # (b, R)
        sft_loss = agg_loss(-log_prob, mask, "token-mean", global_token_count=tokens)
        return sft_loss * scale, {"sft_loss": sft_loss.detach()}
