"""The PPO/GRPO driver: a plain loop over the RL dataflow with a handle per role.

    trainer = PPOTrainer(cfg, start_roles(cfg), actor_dp); trainer.fit()

`step()` reads like the algorithm: the rollout takes the policy's newest weights (a timed phase of
its own, `timing/weight_sync`), the step's prompts and responses come from the rollout (generated
now, launched steps earlier when generating ahead, or a stream's next finished groups), then the
reward, DAPO's dynamic sampling, old log-probs, reference, teacher, values, advantages and the
updates, each a line with a timer around it. Where the responses come from and when weights reach
the engines are the rollout handle's (hybridflow/trainer/rollout/, the recipe's one from
`make_rollout`); what the policy is, the policy handle's (hybridflow/trainer/policy.py); the other
roles' handles are in hybridflow/trainer/handles.py. Everything else is setup, validation, logging
and checkpoint hooks.
"""

from pathlib import Path

import torch

from hybridflow.checks.models import checkpoint_size_estimate
from hybridflow.config.loader import to_dict
from hybridflow.config.schema import RecipeConfig
from hybridflow.data.dataloader import ResumableDataLoader
from hybridflow.data.prompt_dataset import collate_prompts
from hybridflow.data.recipe_datasets import policy_processor, recipe_prompt_dataset
from hybridflow.protocol import DataProto, DataProtoConfig
from hybridflow.reward.manager import compute_rewards, sequence_scores
from hybridflow.reward.registry import load_reward_fn, rule_reward_fn
from hybridflow.single_controller.errors import WorkerError
from hybridflow.trainer import core, metrics
from hybridflow.trainer.balance import balanced_order
from hybridflow.trainer.checkpoint import (
    CheckpointError,
    CheckpointManager,
    restore_rng_state,
    save_trainer_state,
)
from hybridflow.trainer.dynamic_sampling import collect_varied_groups
from hybridflow.trainer.handles import Reference
from hybridflow.trainer.mismatch import check_mismatch
from hybridflow.trainer.prompts import PromptBatches
from hybridflow.trainer.resume import ResumePlan, plan_resume
from hybridflow.trainer.roles import Roles, uses_reference
from hybridflow.trainer.rollout.make import make_rollout
from hybridflow.trainer.samples import SampleLog
from hybridflow.trainer.validation import run_validation
from hybridflow.utils.nonfinite import (
    NonFiniteError,
    StepRefusedError,
    UpdateTooLargeError,
    nonfinite_update,
    refused_updates,
)
from hybridflow.utils.teardown import closing_after
from hybridflow.utils.tracking import Tracking

FROM_RECIPE = "from_recipe"


class PPOTrainer:
    def __init__(self, cfg: RecipeConfig, roles: Roles, actor_dp: int, restarts: int = 0):
        from transformers import AutoTokenizer

        self.cfg, self.actor_dp = cfg, actor_dp
        self.policy, self.critic, self.reward_model = roles.policy, roles.critic, roles.reward_model
        self.teacher = roles.teacher  # on-policy distillation: scores the student's responses
        # the frozen reference, in the policy's processes, when KL is in the reward or the loss
        self.reference = Reference(roles.policy.group) if uses_reference(cfg) else None
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer_path or cfg.model.path)
        self.processor = policy_processor(cfg)  # a vision-language policy's, for its image prompts
        custom = load_reward_fn(cfg.reward.custom_fn) if cfg.reward.custom_fn else None
        self.reward_fn = custom or rule_reward_fn(cfg.reward.format_score)
        self.val_reward_fn = custom or rule_reward_fn(0.0)  # format credit is not accuracy
        self.train_loader = self._loader(cfg.data.train_files, cfg.data.train_max_samples, train=True)
        self.val_loader = (
            self._loader(cfg.data.val_files, cfg.data.val_max_samples) if cfg.data.val_files else None
        )
        # the agent, or the environment loop, reads each row's messages
        self.rollout_reads_rows = cfg.rollout.agent.loop in ("openai", "environment")
        self.prompts = PromptBatches(self.train_loader, cfg.rollout.sampling.n, self.rollout_reads_rows)
        pad_token_id = self.tokenizer.pad_token_id
        self.rollout = make_rollout(cfg, roles.policy.group, roles.rollout_group, self.prompts, pad_token_id)
        self.kl_ctrl = core.make_kl_controller(cfg.algorithm.kl_ctrl)
        self.total_steps = (
            cfg.trainer.total_training_steps or len(self.train_loader) * cfg.trainer.total_epochs
        )
        self.output_dir = Path(cfg.trainer.output_dir)
        self.checkpoints = CheckpointManager(
            self.output_dir / "checkpoints", cfg.trainer.max_ckpt_to_keep, checkpoint_size_estimate(cfg)
        )
        self.global_step = 0
        self.samples: SampleLog | None = None  # trainer.save_samples; opened by fit (fresh start or resume)
        self.skipped_steps = 0  # steps dropped for a NaN / inf or a too large update (policy "skip")
        self.restarts = restarts  # of this run's workers after a process died (trainer.restart_on_failure)

    def _loader(self, files: list[str], max_samples: int | None, train: bool = False) -> ResumableDataLoader:
        data = self.cfg.data
        dataset = recipe_prompt_dataset(self.cfg, self.tokenizer, files, max_samples, self.processor)
        batch_size = data.train_batch_size if train else (data.val_batch_size or len(dataset))
        return ResumableDataLoader(
            dataset,
            batch_size,
            collate_fn=lambda items: collate_prompts(items, self.tokenizer.pad_token_id),
            shuffle=data.shuffle and train,
            seed=data.seed,
        )

    # ------------------------------------------------------------------ the loop
    def fit(self, resume_plan: ResumePlan | str | None = FROM_RECIPE) -> None:
        """Train to the end. `resume_plan`: what `plan_resume(cfg)` returned before the workers
        started (None: a fresh start); by default it is worked out here."""
        resumed_step = self.resume(plan_resume(self.cfg) if resume_plan == FROM_RECIPE else resume_plan)
        if self.cfg.trainer.save_samples:
            self.samples = SampleLog(self.output_dir, resumed_step)
        tracker = Tracking(
            self.output_dir,
            backends=self.cfg.trainer.logger,
            project_name=self.cfg.trainer.project_name,
            experiment_name=self.cfg.trainer.experiment_name,
            config=to_dict(self.cfg),
            total_steps=self.total_steps,
            resume_step=resumed_step,
        )
        with closing_after("closing the tracker (metrics files, plots)", tracker.close):
            if self.cfg.trainer.val_before_train and self.global_step == 0:
                tracker.log(self.validate(), step=0)
            self.train(tracker)
            if self.cfg.trainer.export_hf:
                self.policy.export_hf(str(self.output_dir / "hf"))

    def train(self, tracker: Tracking) -> None:
        """Steps until total_steps, over as many epochs of the data as that takes."""
        while self.global_step < self.total_steps:
            self.global_step += 1
            step_metrics = self.finite_step()
            if self._due(self.cfg.trainer.test_freq):
                step_metrics.update(self.validate())
            if self.cfg.trainer.restart_on_failure:
                step_metrics["trainer/restarts"] = self.restarts
            tracker.log(step_metrics, step=self.global_step)
            if self._due(self.cfg.trainer.save_freq):
                self.save_checkpoint()

    def finite_step(self) -> dict[str, float]:
        """`step()`, stopped by a NaN / inf reward, loss or grad norm, or by an update beyond
        max_update_ratio (the workers apply no such optimizer step), or with
        trainer.nonfinite_policy skip, counted instead."""
        try:
            step_metrics = self.step()
            problems = nonfinite_update(step_metrics)
            if problems:
                raise NonFiniteError(
                    f"{', '.join(problems)} (no optimizer step with a non-finite grad norm was applied)"
                )
            refused = refused_updates(step_metrics, self.cfg)
            if refused:
                raise UpdateTooLargeError(
                    f"{', '.join(refused)}: an optimizer step would move the weights by that fraction of "
                    "their norm, a collapse (check the lr); no such step was applied"
                )
        except StepRefusedError as err:
            if self.cfg.trainer.nonfinite_policy == "error":
                raise type(err)(
                    f"step {self.global_step}: {err}; the run stops with no checkpoint or export of "
                    "this state (trainer.nonfinite_policy=skip skips such steps instead)"
                ) from None
            self.skipped_steps += 1
            print(f"step {self.global_step} skipped: {err}", flush=True)
            step_metrics = {}
        return {**step_metrics, "nonfinite/skipped_steps": self.skipped_steps}

    def _due(self, freq: int) -> bool:
        return freq > 0 and (self.global_step % freq == 0 or self.global_step == self.total_steps)

    def step(self) -> dict[str, float]:
        """One PPO step over the next batch of prompts; returns its metrics."""
        timings = {}
        with metrics.timer("step", timings):
            self.sync_weights(timings)  # the rollout takes the policy's newest weights
            batch = self.generate(timings)  # responses from the rollout
            batch = self.reward(batch, timings)  # their scores: rule or reward model, overlong penalty
            batch, sampling_metrics = self.dynamic_sampling(batch, timings)  # DAPO: more groups as needed
            self.balance(batch)
            with metrics.timer("old_log_prob", timings):
                log_probs = self.policy.log_probs(batch)
                batch = batch.union(log_probs)
            mismatch_metrics = check_mismatch(batch, self.cfg.trainer, self.global_step)  # may stop the run
            mismatch_metrics |= metrics.mean_worker_metrics(log_probs)  # MoE routing replay's agreement
            if self.reference is not None:
                with metrics.timer("ref", timings):
                    batch = batch.union(self.reference.log_probs(batch))
            if self.teacher is not None:
                with metrics.timer("teacher", timings):
                    batch = batch.union(self.teacher.log_probs(batch))
            if self.critic is not None:
                with metrics.timer("values", timings):
                    batch = batch.union(self.critic.values(batch))
            with metrics.timer("adv", timings):
                rewards, kl_metrics = core.token_level_rewards(batch, self.cfg.algorithm, self.kl_ctrl)
                batch = batch.union(rewards)
                batch = batch.union(core.compute_advantage(batch, self.cfg.algorithm))
            update_metrics = self.update_models(batch, timings)  # the critic's and the policy's weights move
            if self.samples is not None:
                self.samples.write(self.global_step, batch, self.tokenizer)  # what the step trained on
        return {
            **metrics.batch_metrics(batch),
            **kl_metrics,
            **mismatch_metrics,
            **sampling_metrics,
            **update_metrics,
            **self.rollout.metrics(batch),
            **metrics.timing_metrics(timings),
            **metrics.throughput(batch, timings["step"]),
        }

    def sync_weights(self, timings: dict[str, float]) -> None:
        """The policy's current weights into the rollout engines (nothing moves where they serve
        that version already)."""
        with metrics.timer("weight_sync", timings):
            self.rollout.sync_weights(self.policy)

    def reward(self, batch: DataProto, timings: dict[str, float]) -> DataProto:
        """`token_level_scores` of the responses (rule or reward model, plus DAPO's overlong
        penalty when enabled)."""
        with metrics.timer("reward", timings):
            if self.reward_model is not None:
                batch = batch.union(self.reward_model.scores(batch))
            batch = batch.union(compute_rewards(batch, self.tokenizer, self.reward_fn))
            overlong = self.cfg.algorithm.overlong_buffer
            if overlong.enable:
                limit = self.cfg.rollout.max_new_tokens(self.cfg.rollout.sampling)
                scores = batch.batch["token_level_scores"]
                batch.batch["token_level_scores"] = scores + core.overlong_scores(batch, overlong, limit)
        return batch

    def dynamic_sampling(
        self, batch: DataProto, timings: dict[str, float]
    ) -> tuple[DataProto, dict[str, float]]:
        """With DAPO's dynamic sampling (algorithm.filter_groups) only the groups whose rewards
        differ, drawing, generating and scoring more prompts as needed; else the batch as it is."""
        dynamic = self.cfg.algorithm.filter_groups
        if not dynamic.enable:
            return batch, {}
        return collect_varied_groups(
            batch,
            lambda: self.reward(self.generate(timings), timings),
            groups_needed=self.cfg.data.train_batch_size,
            n=self.cfg.rollout.sampling.n,
            max_gen_batches=dynamic.max_num_gen_batches,
            pad_token_id=self.tokenizer.pad_token_id,
        )

    def balance(self, batch: DataProto) -> None:
        """With trainer.balance_batch, the rows ordered so that every data-parallel rank gets a
        similar number of tokens."""
        if self.cfg.trainer.balance_batch:
            batch.reorder(balanced_order(batch.batch["attention_mask"].sum(-1).tolist(), self.actor_dp))

    def generate(self, timings: dict[str, float]) -> DataProto:
        """The step's prompts with n responses each (grouped by `uid`), and ReMax's greedy baseline
        when needed; which prompts is the rollout's choice (the loader's next batch, or a stream's
        next finished groups)."""
        with metrics.timer("gen", timings):
            steps_left = self.total_steps - self.global_step
            step, responses = self.rollout.responses(self.prompts, steps_left)
        batch = step.batch.repeat(self.cfg.rollout.sampling.n, interleave=True).union(responses)
        if self.cfg.algorithm.adv_estimator == "remax":
            with metrics.timer("gen_baseline", timings):
                baselines = self.greedy_baseline(step.prompts, step.batch)  # (B,)
            batch.batch["reward_baselines"] = baselines.repeat_interleave(self.cfg.rollout.sampling.n)
        return batch

    def update_models(self, batch: DataProto, timings: dict[str, float]) -> dict[str, float]:
        """The critic's update and, once the critic's warm-up steps are over, the policy's; on a
        pool of its own the critic updates while the policy does."""
        out = {}
        with metrics.timer("update", timings):
            critic_update = self.critic.start_update(batch) if self.critic is not None else None
            if self.global_step > self.cfg.critic.warmup_steps:
                with metrics.timer("update_actor", timings):
                    out.update(metrics.mean_worker_metrics(self.policy.update(batch)))
            if critic_update is not None:  # timing/update_critic: the wait beyond the actor's update
                with metrics.timer("update_critic", timings):
                    out.update(metrics.mean_worker_metrics(critic_update.get()))
        return out

    def greedy_baseline(self, prompts: DataProto, batch: DataProto) -> torch.Tensor:
        """ReMax's baseline (B,): the reward of the greedy response to each prompt (the rollout's
        validation sampling, which the recipe check requires to be greedy), scored like the samples."""
        # B prompts need not split evenly over the data-parallel ranks (B * n responses do)
        meta = {"validate": True, "n": 1, DataProtoConfig.auto_padding_key: True}
        greedy_prompts = DataProto.from_dict(
            dict(prompts.batch.items()), non_tensors=dict(prompts.non_tensor_batch), meta_info=meta
        )  # the prompt tensors and, for image prompts, their pixels
        greedy = self.rollout.generate(greedy_prompts)
        greedy.non_tensor_batch.update(batch.non_tensor_batch)
        if self.reward_model is None:
            return sequence_scores(greedy, self.tokenizer, self.reward_fn)
        greedy.meta_info[DataProtoConfig.auto_padding_key] = True
        return self.reward_model.scores(greedy).batch["rm_scores"].sum(dim=-1)

    def validate(self) -> dict[str, float]:
        """One pass over the validation set (its loader is unshuffled: every pass is the same),
        with the policy's current weights: `val/policy_version` their version (a rollout pool's
        engines report the version they served)."""
        self.rollout.sync_weights(self.policy)
        rows = self.rollout_reads_rows
        scored = run_validation(self.rollout, self.val_loader, self.tokenizer, self.val_reward_fn, rows)
        return {"val/policy_version": float(self.policy.version), **scored}

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self) -> Path:
        """The policy, the rollout (sampling positions, what is in flight), the critic and the
        driver's state, each a part of its own."""
        parts = ["actor", "rollout", "trainer_state.pt"] + (["critic"] if self.critic is not None else [])

        def write(directory: Path) -> None:
            self.policy.save(str(directory / "actor"))
            (directory / "rollout").mkdir()
            self.rollout.save(str(directory / "rollout"))
            if self.critic is not None:
                self.critic.save(str(directory / "critic"))
            save_trainer_state(
                directory / "trainer_state.pt",
                self.global_step,
                self.train_loader.state_dict(),
                config=to_dict(self.cfg),
                extra={"kl_coef": self.kl_ctrl.value, "nonfinite_skipped_steps": self.skipped_steps},
            )

        try:
            return self.checkpoints.save(self.global_step, write, parts)
        except (OSError, WorkerError, CheckpointError) as err:
            raise self.checkpoints.save_failed(self.global_step, err) from err

    def resume(self, plan: ResumePlan | None) -> int | None:
        """Loads the checkpoint of `plan` (see resume.plan_resume) into the workers and the driver;
        returns its step, or None for a fresh start."""
        if plan is None:
            return None
        point, state = plan.point, plan.state
        self.policy.load(str(point.part("actor")))
        self.rollout.load(str(point.part("rollout")))
        if self.critic is not None:
            self.critic.load(str(point.part("critic")))
        restore_rng_state(state["rng"])
        self.train_loader.load_state_dict(state["dataloader"])
        self.kl_ctrl.value = state["extra"]["kl_coef"]
        self.skipped_steps = state["extra"].get("nonfinite_skipped_steps", 0)
        self.global_step = state["global_step"]
        print(f"resumed from {point.path} at step {self.global_step}", flush=True)
        return self.global_step
