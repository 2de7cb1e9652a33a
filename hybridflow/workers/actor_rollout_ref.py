"""The policy worker: actor (PPO updates), rollout (generation) and reference (frozen policy)
in one process per device, sharing Megatron's parallel state.

`role` picks what this worker builds: "actor_rollout" (no reference), "actor_rollout_ref", or
"ref" (a standalone reference). Engines are imported inside `init_model`, so importing this
module (the driver does) stays free of Megatron.
"""

from pathlib import Path

import torch

from hybridflow.config.schema import RecipeConfig
from hybridflow.protocol import DataProto
from hybridflow.single_controller import Dispatch, Worker, register
from hybridflow.workers.megatron_setup import init_parallel_state

ROLES = ("actor_rollout", "actor_rollout_ref", "ref")


def prefixed(role: str, metrics: dict) -> dict:
    """Engine metric names under the role: pg_loss -> actor/pg_loss, sft_loss -> sft/loss."""
    return {f"{role}/{key.removeprefix(role + '_')}": value for key, value in metrics.items()}


class ActorRolloutRefWorker(Worker):
    def __init__(self, config: RecipeConfig, role: str = "actor_rollout_ref"):
        if role not in ROLES:
            raise ValueError(f"ActorRolloutRefWorker role must be one of {ROLES}, got {role!r}")
        self.config = config
        self.has_actor = role.startswith("actor_rollout")
        self.has_ref = role.endswith("ref")

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        from engines.megatron.build import build_model

        cfg = self.config
        init_parallel_state(self, cfg.actor.megatron, cfg.rollout)
        if self.has_actor:
            self._build_actor_and_rollout()
        self.ref = None  # with LoRA the reference is the actor's base model: adapters off
        if self.has_ref and not (self.has_actor and cfg.actor.lora.rank):
            from engines.megatron.actor import MegatronActor

            ref_chunks = build_model(cfg.model.path, cfg.actor.megatron, for_training=False)
            self.ref = MegatronActor(ref_chunks, update_cfg=cfg.actor.update)  # frozen: no optimizer

    def _build_actor_and_rollout(self) -> None:
        from engines.megatron.actor import MegatronActor
        from engines.megatron.build import build_model
        from engines.megatron.model import unwrap_model
        from engines.megatron.offload import actor_offload_hooks
        from engines.megatron.optimizer import build_optimizer
        from engines.rollout.sharding_manager import MegatronRolloutShardingManager

        cfg = self.config
        self.actor_chunks = build_model(cfg.model.path, cfg.actor.megatron, lora=cfg.actor.lora)
        self.optimizer, self.scheduler = build_optimizer(
            self.actor_chunks, cfg.actor.optim, cfg.actor.megatron
        )
        self.actor = MegatronActor(self.actor_chunks, self.optimizer, self.scheduler, cfg.actor.update)
        self.rollout = self._build_rollout_engine()
        self.generator = self.rollout  # what generates: the engine, or agent loops over it
        if cfg.rollout.agent.loop != "single_turn":
            from hybridflow.agents.rollout import build_agent_rollout

            tokenizer_dir = cfg.model.tokenizer_path or cfg.model.path
            self.generator = build_agent_rollout(self.rollout, cfg.rollout, tokenizer_dir)
        hooks = actor_offload_hooks(cfg.actor.megatron, self.actor_chunks, self.optimizer)
        self.hf_config = unwrap_model(self.actor_chunks[0]).hf_config
        self.sharding_manager = MegatronRolloutShardingManager(
            self.actor_chunks, self.hf_config, self.rollout, cfg.rollout, offload_hooks=hooks
        )

    def _build_rollout_engine(self):
        """The hf engine on every rank; one SGLang engine per rollout group (SGLang TP), on the
        group's first rank, started on the group's GPUs (`engines.placement`)."""
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

    def teardown(self) -> None:
        """Stop the rollout engine (SGLang's scheduler processes); the worker group calls it."""
        if getattr(self, "rollout", None) is not None:
            self.rollout.shutdown()

    @register(dispatch_mode=Dispatch.MEGATRON_COMPUTE_PROTO)
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """Responses for a chunk of prompts, with the actor's current weights synced in first."""
        self.sharding_manager.load_weights()
        with self.sharding_manager.generating():
            piece = self.sharding_manager.preprocess_data(prompts)
            output = self.generator.generate_sequences(piece) if self.rollout is not None else None
            return self.sharding_manager.postprocess_data(output)

    def _log_prob_meta(self, data: DataProto, role) -> DataProto:
        """Temperature and micro-batching of a log-prob pass; `role` is the actor or ref config."""
        data.meta_info.update(
            temperature=self.config.rollout.sampling.temperature,
            micro_batch_size=role.log_prob_micro_batch_size,
        )
        packed = self.config.actor.update.use_dynamic_bsz
        data.meta_info["max_token_len"] = role.log_prob_max_token_len_per_gpu if packed else None
        return data

    @register(dispatch_mode=Dispatch.MEGATRON_COMPUTE_PROTO)
    def compute_log_prob(self, data: DataProto) -> DataProto:
        """`old_log_probs` and `entropys` (B, R) of the responses under the current actor."""
        data = self._log_prob_meta(data, self.config.actor)
        return self.actor.compute_log_prob(data)

    @register(dispatch_mode=Dispatch.MEGATRON_COMPUTE_PROTO)
    def compute_ref_log_prob(self, data: DataProto) -> DataProto | None:
        """`ref_log_prob` (B, R) of the responses under the frozen reference policy (on the last
        pipeline stage, the one whose output is collected)."""
        data = self._log_prob_meta(data, self.config.ref)
        if self.ref is not None:
            return self.ref.compute_ref_log_prob(data)
        from engines.megatron.lora import adapters_disabled

        with adapters_disabled(self.actor_chunks):
            return self.actor.compute_ref_log_prob(data)

    @register(dispatch_mode=Dispatch.MEGATRON_COMPUTE_PROTO)
    def update_actor(self, data: DataProto) -> DataProto:
        """PPO epochs over the batch; metrics come back in meta_info["metrics"]."""
        data.meta_info["temperature"] = self.config.rollout.sampling.temperature
        metrics = self.actor.update_policy(data)
        if self.config.actor.lora.rank:  # what LoRA saves: trainable elements, optimizer bytes
            from engines.megatron.lora import parameter_counts

            counts = parameter_counts(self.actor_chunks, self.optimizer)
            metrics.update({name: [float(value)] for name, value in counts.items()})
        return DataProto(meta_info={"metrics": prefixed("actor", metrics)})

    @register(dispatch_mode=Dispatch.MEGATRON_COMPUTE_PROTO)
    def train_sft(self, data: DataProto) -> DataProto:
        """One supervised step on (prompt, response) sequences (the SFT mode)."""
        return DataProto(meta_info={"metrics": prefixed("sft", self.actor.update_sft(data))})

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, path: str) -> None:
        """Model, optimizer, LR schedule and RNG (Megatron dist checkpoint, loadable at another
        layout) into `path`, plus each rank's rollout sampling position."""
        from engines.megatron.checkpoint import save_checkpoint

        save_checkpoint(self.actor_chunks, self.optimizer, self.scheduler, path)
        if self.rollout is not None:
            rollout_dir = Path(path) / "rollout"
            rollout_dir.mkdir(exist_ok=True)
            rank = torch.distributed.get_rank()
            torch.save(self.generator.get_rng_state(), rollout_dir / f"rank_{rank}.pt")

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, path: str) -> None:
        from engines.megatron.checkpoint import load_checkpoint

        load_checkpoint(self.actor_chunks, self.optimizer, self.scheduler, path)
        rollout_state = Path(path) / "rollout" / f"rank_{torch.distributed.get_rank()}.pt"
        if self.rollout is not None and rollout_state.is_file():  # absent after a layout change
            self.generator.set_rng_state(torch.load(rollout_state, weights_only=True))

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def export_hf(self, out_dir: str) -> None:
        """The actor as a Hugging Face checkpoint (safetensors + config + tokenizer) in `out_dir`."""
        from engines.megatron.weights import save_hf_checkpoint

        tokenizer_dir = self.config.model.tokenizer_path or self.config.model.path
        save_hf_checkpoint(self.actor_chunks, self.hf_config, out_dir, tokenizer_dir=tokenizer_dir)
