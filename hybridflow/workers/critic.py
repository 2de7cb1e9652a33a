"""The value model worker for GAE: a Megatron model with a scalar value head per token.

Engines are imported inside `init_model`, so importing this module stays free of Megatron.
"""

import time

from hybridflow.config.schema import RecipeConfig
from hybridflow.protocol import DataProto
from hybridflow.single_controller import Dispatch, Worker, register
from hybridflow.workers.megatron_setup import init_parallel_state
from hybridflow.workers.policy import prefixed, update_timing


class CriticWorker(Worker):
    def __init__(self, config: RecipeConfig):
        self.config = config

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        from engines.megatron.build import build_model
        from engines.megatron.critic import MegatronCritic
        from engines.megatron.optimizer import build_optimizer

        cfg = self.config.critic
        init_parallel_state(self, cfg.megatron, self.config.rollout)
        # A fresh value head on the policy's (or the given model's) transformer.
        self.chunks = build_model(cfg.model_path or self.config.model.path, cfg.megatron, value_head=True)
        self.optimizer, self.scheduler = build_optimizer(self.chunks, cfg.optim, cfg.megatron)
        self.critic = MegatronCritic(self.chunks, self.optimizer, self.scheduler, cfg.update)

    @register(dispatch_mode=Dispatch.MEGATRON_COMPUTE_PROTO)
    def compute_values(self, data: DataProto) -> DataProto:
        """`values` (B, R): the value head's output at the positions that predict each response token."""
        cfg = self.config.critic
        data.meta_info["max_token_len"] = (
            cfg.forward_max_token_len_per_gpu if cfg.update.use_dynamic_bsz else None
        )
        return self.critic.compute_values(data)

    @register(dispatch_mode=Dispatch.MEGATRON_COMPUTE_PROTO)
    def update_critic(self, data: DataProto) -> DataProto:
        """Clipped value-loss epochs over the batch; metrics come back in meta_info["metrics"]."""
        start = time.perf_counter()
        metrics = prefixed("critic", self.critic.update_critic(data))
        return DataProto(meta_info={"metrics": metrics | update_timing("critic", start)})

    @register(dispatch_mode=Dispatch.MEGATRON_COMPUTE_PROTO, blocking=False)
    def update_critic_async(self, data: DataProto) -> DataProto:
        """`update_critic`, the driver getting a DataProtoFuture at once: on a pool of its own the
        critic updates while the policy does."""
        return self.update_critic(data)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, path: str) -> None:
        from engines.megatron.checkpoint import save_checkpoint

        save_checkpoint(self.chunks, self.optimizer, self.scheduler, path)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, path: str) -> None:
        from engines.megatron.checkpoint import load_checkpoint

        load_checkpoint(self.chunks, self.optimizer, self.scheduler, path)
