"""The policy worker: the actor (PPO and SFT updates, log-probs, checkpoints, export) and, when the
recipe uses KL, the frozen reference policy, in one process per device sharing Megatron's parallel
state. With LoRA the reference is the actor's own base model (adapters off), not a second model.

Two subclasses say what else a policy worker holds:
- `HybridPolicyWorker` (hybrid_policy.py): rollout engines in the same processes (colocated);
- `TransferPolicyWorker` (transfer_policy.py): no engine; it sends its weights to a rollout pool.
Engines are imported inside `init_model`, so importing these modules (the driver does) stays free
of Megatron.
"""

import time

from hybridflow.algorithms.advantages import estimator_reads
from hybridflow.config.schema import RecipeConfig
from hybridflow.protocol import DataProto
from hybridflow.single_controller import Dispatch, Worker, register
from hybridflow.workers.megatron_setup import init_parallel_state


def prefixed(role: str, metrics: dict) -> dict:
    """Engine metric names under the role: pg_loss -> actor/pg_loss, sft_loss -> sft/loss."""
    return {f"{role}/{key.removeprefix(role + '_')}": value for key, value in metrics.items()}


def update_timing(role: str, start: float) -> dict:
    """`timing/update_<role>_worker`: the update's own wall time in this worker since `start`. The
    driver's `timing/update_actor` also counts a colocated critic's update queued before it in the
    same processes, and `timing/update_critic` only the wait beyond the actor's. Under `timing/`
    like the driver's timings: wall-clock, left out where runs are compared for equality."""
    return {f"timing/update_{role}_worker": [time.perf_counter() - start]}


class PolicyWorker(Worker):
    def __init__(self, config: RecipeConfig, with_reference: bool = False):
        self.config = config
        self.with_reference = with_reference
        self.ref = None

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        cfg = self.config
        init_parallel_state(self, cfg.actor.megatron, cfg.rollout)
        self._build_actor()
        if self.with_reference and not cfg.actor.lora.rank:
            self._build_reference()

    def _policy_chunks(self, for_training: bool) -> list:
        """The policy's model chunks: a GPT model (with the recipe's LoRA when trained), or for a
        vision-language model.path the LLaVA model (docs/vlm.md)."""
        from engines.megatron.build import build_model, build_vlm_model
        from engines.model_dir import is_vision_language_dir

        cfg = self.config
        path, megatron = cfg.model.path, cfg.actor.megatron
        if is_vision_language_dir(path):
            train_tower = not cfg.actor.freeze_vision_tower
            return build_vlm_model(path, megatron, for_training=for_training, train_vision_tower=train_tower)
        if for_training:
            return build_model(path, megatron, lora=cfg.actor.lora)
        return build_model(path, megatron, for_training=False)

    def _build_actor(self) -> None:
        from engines.megatron.actor import MegatronActor
        from engines.megatron.model import unwrap_model
        from engines.megatron.optimizer import build_optimizer

        cfg = self.config
        self.actor_chunks = self._policy_chunks(for_training=True)
        self.optimizer, self.scheduler = build_optimizer(
            self.actor_chunks, cfg.actor.optim, cfg.actor.megatron
        )
        self.actor = MegatronActor(
            self.actor_chunks,
            self.optimizer,
            self.scheduler,
            cfg.actor.update,
            cfg.algorithm.rollout_correction,
        )
        self.hf_config = unwrap_model(self.actor_chunks[0]).hf_config

    def _build_reference(self) -> None:
        from engines.megatron.actor import MegatronActor

        ref_chunks = self._policy_chunks(for_training=False)
        self.ref = MegatronActor(ref_chunks, update_cfg=self.config.actor.update)  # frozen: no optimizer

    def before_compute(self) -> None:
        """What must happen before the policy computes (the hybrid engine hands the device back)."""

    def _log_prob_meta(self, data: DataProto, role) -> DataProto:
        """Sampling (temperature, top-k, top-p) and micro-batching of a log-prob pass; `role` is the
        actor or ref config. The reference gets the rollout's top-k / top-p too (docs/sampling.md)."""
        sampling = self.config.rollout.sampling
        data.meta_info.update(
            temperature=sampling.temperature,
            micro_batch_size=role.log_prob_micro_batch_size,
            **sampling.filters(),
        )
        packed = self.config.actor.update.use_dynamic_bsz
        data.meta_info["max_token_len"] = role.log_prob_max_token_len_per_gpu if packed else None
        return data

    @register(dispatch_mode=Dispatch.MEGATRON_COMPUTE_PROTO)
    def compute_log_prob(self, data: DataProto) -> DataProto:
        """`old_log_probs` and `entropys` (B, R) of the responses under the current actor, its view of
        the engine's top-K tokens when the rollout returned them (rollout.top_k_log_probs) and
        `sum_pi_squared` (B, R) when the recipe's estimator reads it (optimal_token_baseline)."""
        self.before_compute()
        squares = estimator_reads(self.config.algorithm.adv_estimator, "sum_pi_squared")
        data = self._log_prob_meta(data, self.config.actor)
        return self.actor.compute_log_prob(data, engine_top_k=True, sum_pi_squared=squares)

    @register(dispatch_mode=Dispatch.MEGATRON_COMPUTE_PROTO)
    def compute_ref_log_prob(self, data: DataProto) -> DataProto | None:
        """`ref_log_prob` (B, R) of the responses under the frozen reference policy (on the last
        pipeline stage, the one whose output is collected)."""
        self.before_compute()
        data = self._log_prob_meta(data, self.config.ref)
        if self.ref is not None:
            return self.ref.compute_ref_log_prob(data)
        from engines.megatron.lora import adapters_disabled

        with adapters_disabled(self.actor_chunks):
            return self.actor.compute_ref_log_prob(data)

    @register(dispatch_mode=Dispatch.MEGATRON_COMPUTE_PROTO)
    def update_actor(self, data: DataProto) -> DataProto:
        """PPO epochs over the batch; metrics come back in meta_info["metrics"]."""
        self.before_compute()
        sampling = self.config.rollout.sampling
        data.meta_info.update(temperature=sampling.temperature, **sampling.filters())
        start = time.perf_counter()
        metrics = self.actor.update_policy(data)
        if self.config.actor.lora.rank:  # what LoRA saves: trainable elements, optimizer bytes
            from engines.megatron.lora import parameter_counts

            counts = parameter_counts(self.actor_chunks, self.optimizer)
            metrics.update({name: [float(value)] for name, value in counts.items()})
        return DataProto(meta_info={"metrics": prefixed("actor", metrics) | update_timing("actor", start)})

    @register(dispatch_mode=Dispatch.MEGATRON_COMPUTE_PROTO)
    def train_sft(self, data: DataProto) -> DataProto:
        """One supervised step on (prompt, response) sequences (the SFT mode)."""
        self.before_compute()
        return DataProto(meta_info={"metrics": prefixed("sft", self.actor.update_sft(data))})

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, path: str) -> None:
        """Model, optimizer, LR schedule and RNG (Megatron dist checkpoint, loadable at another
        layout) into `path`."""
        from engines.megatron.checkpoint import save_checkpoint

        self.before_compute()
        save_checkpoint(self.actor_chunks, self.optimizer, self.scheduler, path)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, path: str) -> None:
        from engines.megatron.checkpoint import load_checkpoint

        self.before_compute()
        load_checkpoint(self.actor_chunks, self.optimizer, self.scheduler, path)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def export_hf(self, out_dir: str) -> None:
        """The actor as a Hugging Face checkpoint (safetensors + config + tokenizer) in `out_dir`."""
        from engines.megatron.model import unwrap_model
        from engines.megatron.vlm_weights import save_vlm_hf_checkpoint
        from engines.megatron.weights import save_hf_checkpoint

        self.before_compute()
        model = unwrap_model(self.actor_chunks[0])
        if hasattr(model, "vlm_config"):  # a LLaVA model: config, tokenizer and processor come along
            save_vlm_hf_checkpoint(model, model.vlm_config, self.config.actor.megatron, out_dir)
            return
        tokenizer_dir = self.config.model.tokenizer_path or self.config.model.path
        save_hf_checkpoint(self.actor_chunks, self.hf_config, out_dir, tokenizer_dir=tokenizer_dir)

    def teardown(self) -> None:
        """Nothing to stop: the models live in this process (the worker group calls it)."""
