"""The value model on Megatron-Core: values of response positions and the clipped value update.

`MegatronCritic(chunks, optimizer, scheduler, update_cfg)` wraps chunks built with
`build_model(hf_dir, cfg, value_head=True)`: the policy's backbone with a scalar head, whose
output at position t is the value of the state before token t + 1 (as for log-probs). Methods
are collective; results are complete on the last pipeline stage. Batch keys: the model inputs,
`responses`, `response_mask`, and for the update `values` (old) and `returns`.
"""

import torch

from engines.megatron import forward, packing
from engines.megatron.actor import MODEL_KEYS
from engines.megatron.checks import validate_critic_update_config
from engines.megatron.config import CriticUpdateConfig
from engines.megatron.training import require_keys, require_optimizer, update_epochs
from hybridflow.algorithms import compute_value_loss, masked_sum
from hybridflow.protocol import DataProto


def response_values(output, micro_batch) -> torch.Tensor:
    """(b, T, 1) value-head output (or a packed one) -> (b, R) values of the states the response
    tokens follow, zero on padding."""
    view = forward.ResponseTokens(output, micro_batch)
    values = view.to_rows(view.outputs[..., 0].float())  # (b, R)
    return values * micro_batch["response_mask"]


def last_token_values(output, attention_mask: torch.Tensor) -> torch.Tensor:
    """(b, T, 1) value-head output (or a packed one) -> (b,) output at each row's last real token,
    the one position that has read the whole response (responses are right-padded, so it is the
    last 1 in the mask)."""
    return forward.last_token_outputs(output, attention_mask)[:, 0].float()  # (b,)


class MegatronCritic:
    def __init__(self, chunks, optimizer=None, scheduler=None, update_cfg: CriticUpdateConfig | None = None):
        self.chunks = chunks
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.cfg = update_cfg or CriticUpdateConfig()
        validate_critic_update_config(self.cfg)

    def compute_values(self, data: DataProto) -> DataProto | None:
        """`values` (B, R), zero on padding; meta_info may set `micro_batch_size` and
        `max_token_len` (packed micro-batches of at most that many tokens)."""
        values = self._forward_only(data, _values_only, "compute_values")
        return None if values is None else DataProto.from_dict(tensors={"values": values})

    def compute_sequence_scores(self, data: DataProto) -> DataProto | None:
        """`scores` (B,): the head's output at each sequence's last real token (a reward model's
        score, which must read the response's final token; `values` stop one position short)."""
        scores = self._forward_only(data, _last_token_only, "compute_sequence_scores")
        return None if scores is None else DataProto.from_dict(tensors={"scores": scores})

    def _forward_only(self, data: DataProto, post_process, method: str) -> torch.Tensor | None:
        """Micro-batched forward; the per-row results in row order on the last pipeline stage,
        None on the others. meta_info may set `micro_batch_size` and `max_token_len` (packed)."""
        require_keys(data, MODEL_KEYS, method)
        for chunk in self.chunks:
            chunk.eval()
        data = data.select(batch_keys=list(MODEL_KEYS))
        max_token_len = data.meta_info.get("max_token_len")
        if max_token_len is None:
            micro = data.meta_info.get("micro_batch_size", self.cfg.ppo_micro_batch_size)
        else:
            micro = forward.token_budget_groups(data, max_token_len, f"{method} max_token_len")
        results = forward.run_micro_batches(self.chunks, data, micro, post_process, forward_only=True)
        if not results:
            return None
        return (torch.cat(results) if isinstance(micro, int) else packing.restore_order(results, micro)).cpu()

    def update_critic(self, data: DataProto) -> dict[str, list[float]]:
        """Epochs over mini-batches of the clipped value loss; one value per optimizer step."""
        require_optimizer(self.optimizer, self.scheduler, "update_critic")
        keys = [*MODEL_KEYS, "values", "returns"]
        require_keys(data, keys, "update_critic")
        metrics, _ = update_epochs(
            self.chunks,
            self.optimizer,
            self.scheduler,
            data.select(batch_keys=keys),
            self.cfg,
            "critic",
            self._value_loss,
            shuffle=False,
            seed=0,
        )
        return metrics

    def _value_loss(self, counts, scale, output, micro_batch):
        tokens, seqs = counts
        mask = micro_batch["response_mask"]
        vpreds = response_values(output, micro_batch)  # (b, R)
        vf_loss, vf_clipfrac = compute_value_loss(
            vpreds, micro_batch["values"], micro_batch["returns"], mask,
            self.cfg.cliprange_value, self.cfg.loss_agg_mode, tokens, seqs,
        )  # fmt: skip
        metrics = {
            "vf_loss": vf_loss.detach(),
            "vf_clipfrac": vf_clipfrac * mask.sum() / tokens,
            "vpred_mean": masked_sum(vpreds.detach(), mask) / tokens,
        }
        return vf_loss * scale, metrics


def _values_only(output, micro_batch):
    values = response_values(output, micro_batch)
    return values.new_zeros(()), values


def _last_token_only(output, micro_batch):
    scores = last_token_values(output, micro_batch["attention_mask"])
    return scores.new_zeros(()), scores
