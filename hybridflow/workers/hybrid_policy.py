"""The hybrid engine: a policy worker that also holds rollout engines in the same processes.

The driver moves weights with `sync_rollout_weights(version)` (its rollout handle's sync, a line of
the loop): the sharding manager streams the actor's HF-named tensors into the engines unless they
hold that version already. Generation then runs on the engines; before the policy next computes
(log-probs, an update, a checkpoint) the engines hand the device back (`before_compute`), which
with `rollout.free_cache_engine` drops their weights, so the next sync streams them again.

One SGLang engine per rollout group (SGLang TP), on the group's first rank (`engines.placement`);
the hf and vLLM engines on every rank. Each engine's sampling position is saved with the rollout's
part of a checkpoint (`save_rollout_state`).
"""

from pathlib import Path

import torch

from hybridflow.protocol import DataProto
from hybridflow.single_controller import Dispatch, register
from hybridflow.workers.policy import PolicyWorker


class HybridPolicyWorker(PolicyWorker):
    rollout = None  # the engine (None on the ranks of an SGLang group that are not its first)
    engine_version: int | None = None  # the policy version last loaded (held while holds_weights)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        from engines.megatron.offload import actor_offload_hooks
        from engines.rollout.sharding_manager import MegatronRolloutShardingManager

        super().init_model()
        cfg = self.config
        self.rollout = self._build_rollout_engine()
        self.generator = self.rollout  # what generates: the engine, or agent loops over it
        if cfg.rollout.agent.loop != "single_turn":
            from hybridflow.agents.rollout import build_agent_rollout

            tokenizer_dir = cfg.model.tokenizer_path or cfg.model.path
            self.generator = build_agent_rollout(self.rollout, cfg.rollout, tokenizer_dir)
        hooks = actor_offload_hooks(cfg.actor.megatron, self.actor_chunks, self.optimizer)
        self.sharding_manager = MegatronRolloutShardingManager(
            self.actor_chunks, self.hf_config, self.rollout, cfg.rollout, offload_hooks=hooks
        )

    def _build_rollout_engine(self):
        from engines.rollout.factory import create_rollout_engine

        cfg = self.config
        if cfg.rollout.name == "vllm" and cfg.actor.lora.sync == "adapters":  # takes LoRA adapters
            return create_rollout_engine(cfg.rollout, cfg.model.path, lora_rank=cfg.actor.lora.rank)
        if cfg.rollout.name != "sglang":
            return create_rollout_engine(cfg.rollout, cfg.model.path)
        from engines.placement import gather_engine_devices

        devices = gather_engine_devices(cfg.rollout.tensor_model_parallel_size, torch.cuda.device_count())
        if devices is None:
            return None
        return create_rollout_engine(cfg.rollout, cfg.model.path, devices=devices)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def sync_rollout_weights(self, version: int) -> None:
        """The actor's weights into the engines as policy `version` (collective), unless they hold it."""
        if self.engine_version == version and self.sharding_manager.holds_weights:
            return
        self.sharding_manager.load_weights()
        self.engine_version = version

    @register(dispatch_mode=Dispatch.MEGATRON_COMPUTE_PROTO)
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """Responses for a chunk of prompts, with the weights of the last sync."""
        if not self.sharding_manager.holds_weights:
            raise RuntimeError(
                "generate_sequences before sync_rollout_weights: the engines hold no weights of the policy"
            )
        self.sharding_manager.start_generating()
        piece = self.sharding_manager.preprocess_data(prompts)
        output = self.generator.generate_sequences(piece) if self.rollout is not None else None
        return self.sharding_manager.postprocess_data(output)

    def before_compute(self) -> None:
        """The engines hand the device back to the policy (their weights too, with free_cache_engine)."""
        self.sharding_manager.release()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_rollout_state(self, path: str) -> None:
        """This rank's sampling position into `path`/rank_<rank>.pt."""
        if self.rollout is not None:
            torch.save(self.generator.get_rng_state(), Path(path) / f"rank_{torch.distributed.get_rank()}.pt")

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_rollout_state(self, path: str) -> None:
        """What `save_rollout_state` wrote; the engines get the weights at the next sync."""
        self.engine_version = None
        state = Path(path) / f"rank_{torch.distributed.get_rank()}.pt"
        if self.rollout is not None and state.is_file():  # absent after a layout change
            self.generator.set_rng_state(torch.load(state, weights_only=True))

    def teardown(self) -> None:
        """Stop the rollout engine (SGLang's scheduler processes); the worker group calls it."""
        if self.rollout is not None:
            self.rollout.shutdown()
