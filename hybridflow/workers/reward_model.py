"""The learned reward model: a value-style Megatron model (transformer + scalar head) whose output
at the last real token of each response is the sequence's score.

Engines are imported inside `init_model`, so importing this module stays free of Megatron.
"""

from hybridflow.config.schema import RecipeConfig
from hybridflow.protocol import DataProto
from hybridflow.reward.manager import place_on_last_token
from hybridflow.single_controller import Dispatch, Worker, register
from hybridflow.workers.megatron_setup import init_parallel_state


class RewardModelWorker(Worker):
    def __init__(self, config: RecipeConfig):
        self.config = config

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        from engines.megatron.build import build_model
        from engines.megatron.critic import MegatronCritic

        cfg = self.config.reward_model
        init_parallel_state(self, cfg.megatron, self.config.rollout)
        self.chunks = build_model(cfg.path, cfg.megatron, value_head=True, for_training=False)
        # Forward only: the critic's value computation without an optimizer.
        self.scorer = MegatronCritic(self.chunks, None, None, self.config.critic.update)

    @register(dispatch_mode=Dispatch.MEGATRON_COMPUTE_PROTO)
    def compute_rm_score(self, data: DataProto) -> DataProto | None:
        """`rm_scores` (B, R): the model's score of each whole sequence (its head at the last real
        token), placed on the response's last token. Only the last pipeline stage has scores (and
        is the one collected); the other stages return None."""
        cfg = self.config.reward_model
        data.meta_info["micro_batch_size"] = cfg.micro_batch_size
        data.meta_info["max_token_len"] = cfg.forward_max_token_len_per_gpu if cfg.use_dynamic_bsz else None
        out = self.scorer.compute_sequence_scores(data)
        if out is None:
            return None
        scores = out.batch["scores"]  # (B,)
        return DataProto.from_dict({"rm_scores": place_on_last_token(scores, data.batch["response_mask"])})
