"""The PPO/GRPO driver: a plain loop over the RL dataflow, one worker-group call per stage.

    trainer = PPOTrainer(cfg, start_roles(cfg)); trainer.fit()

`step()` reads like the algorithm (generate, reward, old log-probs, reference, values,
advantages, critic update, actor update) with a timer around each stage; everything else is
setup, validation, logging and checkpoint hooks.
"""

from pathlib import Path

import torch

from hybridflow.agents.tools.base import prompt_tools
from hybridflow.config.loader import to_dict
from hybridflow.config.schema import RecipeConfig
from hybridflow.data.dataloader import ResumableDataLoader
from hybridflow.data.prompt_dataset import PromptDataset, collate_prompts
from hybridflow.protocol import DataProto, DataProtoConfig
from hybridflow.reward.manager import compute_rewards, sequence_scores
from hybridflow.reward.registry import load_reward_fn, rule_reward_fn
from hybridflow.single_controller.errors import WorkerError
from hybridflow.trainer import core, metrics
from hybridflow.trainer.async_loop import GenerationAhead
from hybridflow.trainer.balance import balanced_order
from hybridflow.trainer.checkpoint import (
    CheckpointError,
    CheckpointManager,
    restore_rng_state,
    save_trainer_state,
)
from hybridflow.trainer.dynamic_sampling import collect_varied_groups
from hybridflow.trainer.preflight import checkpoint_size_estimate
from hybridflow.trainer.resume import ResumePlan, plan_resume
from hybridflow.trainer.roles import RoleGroups, uses_reference
from hybridflow.trainer.validation import pop_prompts, run_validation
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
    def __init__(self, cfg: RecipeConfig, roles: RoleGroups, actor_dp: int):
        from transformers import AutoTokenizer

        self.cfg, self.roles, self.actor_dp = cfg, roles, actor_dp
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer_path or cfg.model.path)
        custom = load_reward_fn(cfg.reward.custom_fn) if cfg.reward.custom_fn else None
        self.reward_fn = custom or rule_reward_fn(cfg.reward.format_score)
        self.val_reward_fn = custom or rule_reward_fn(0.0)  # format credit is not accuracy
        self.train_loader = self._loader(cfg.data.train_files, cfg.data.train_max_samples, train=True)
        self.val_loader = (
            self._loader(cfg.data.val_files, cfg.data.val_max_samples) if cfg.data.val_files else None
        )
        self.use_ref = uses_reference(cfg)
        self.rollout_reads_rows = cfg.rollout.agent.loop == "openai"  # the agent reads each row's messages
        self.kl_ctrl = core.make_kl_controller(cfg.algorithm.kl_ctrl)
        self.total_steps = (
            cfg.trainer.total_training_steps or len(self.train_loader) * cfg.trainer.total_epochs
        )
        self.output_dir = Path(cfg.trainer.output_dir)
        self.checkpoints = CheckpointManager(
            self.output_dir / "checkpoints", cfg.trainer.max_ckpt_to_keep, checkpoint_size_estimate(cfg)
        )
        self.global_step = 0
        self.skipped_steps = 0  # steps dropped for a NaN / inf or a too large update (policy "skip")
        if cfg.trainer.async_training.mode != "sync":  # next batches generate during the update
            GenerationAhead.attach(self)

    def _loader(self, files: list[str], max_samples: int | None, train: bool = False) -> ResumableDataLoader:
        data = self.cfg.data
        tools = prompt_tools(self.cfg.rollout.agent)
        dataset = PromptDataset(
            files, self.tokenizer, data.max_prompt_length, data.prompt_key, max_samples, tools
        )
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
                self.roles.actor_rollout.export_hf(str(self.output_dir / "hf"))

    def train(self, tracker: Tracking) -> None:
        """Steps until total_steps, over as many epochs of the data as that takes."""
        while self.global_step < self.total_steps:
            self.global_step += 1
            step_metrics = self.finite_step(self.next_batch())
            if self._due(self.cfg.trainer.test_freq):
                step_metrics.update(self.validate())
            tracker.log(step_metrics, step=self.global_step)
            if self._due(self.cfg.trainer.save_freq):
                self.save_checkpoint()

    def next_batch(self) -> dict:
        """The loader's next batch of prompts, going on to the next epoch when this one is used up
        (the loader keeps the position, so a step may draw several: dynamic sampling)."""
        batch_dict = next(iter(self.train_loader), None)
        return batch_dict if batch_dict is not None else next(iter(self.train_loader))

    def finite_step(self, batch_dict: dict) -> dict[str, float]:
        """`step()`, stopped by a NaN / inf reward, loss or grad norm, or by an update beyond
        max_update_ratio (the workers apply no such optimizer step), or with
        trainer.nonfinite_policy skip, counted instead."""
        try:
            step_metrics = self.step(batch_dict)
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

    def step(self, batch_dict: dict) -> dict[str, float]:
        """One PPO step over a batch of prompts; returns its metrics."""
        roles, timings = self.roles, {}
        with metrics.timer("step", timings):
            batch, sampling_metrics = self.sample(batch_dict, timings)
            with metrics.timer("old_log_prob", timings):
                batch = batch.union(roles.actor_rollout.compute_log_prob(batch))
            if self.use_ref:
                with metrics.timer("ref", timings):
                    batch = batch.union(roles.actor_rollout.compute_ref_log_prob(batch))
            if roles.critic is not None:
                with metrics.timer("values", timings):
                    batch = batch.union(roles.critic.compute_values(batch))
            with metrics.timer("adv", timings):
                rewards, kl_metrics = core.token_level_rewards(batch, self.cfg.algorithm, self.kl_ctrl)
                batch = batch.union(rewards)
                batch = batch.union(core.compute_advantage(batch, self.cfg.algorithm))
            worker_metrics = self.update_models(batch, timings)
        return {
            **metrics.batch_metrics(batch),
            **kl_metrics,
            **sampling_metrics,
            **worker_metrics,
            **metrics.timing_metrics(timings),
            **metrics.throughput(batch, timings["step"]),
        }

    def sample(self, batch_dict: dict, timings: dict[str, float]) -> tuple[DataProto, dict[str, float]]:
        """Scored responses to the step's prompts (with DAPO's dynamic sampling: only groups whose
        rewards differ, drawing more prompts as needed), ordered so that every data-parallel rank
        gets a similar number of tokens."""
        batch, sampling_metrics = self.generate_and_score(batch_dict, timings), {}
        dynamic = self.cfg.algorithm.filter_groups
        if dynamic.enable:
            batch, sampling_metrics = collect_varied_groups(
                batch,
                lambda: self.generate_and_score(self.next_batch(), timings),
                groups_needed=self.cfg.data.train_batch_size,
                n=self.cfg.rollout.sampling.n,
                max_gen_batches=dynamic.max_num_gen_batches,
                pad_token_id=self.tokenizer.pad_token_id,
            )
        if self.cfg.trainer.balance_batch:
            batch.reorder(balanced_order(batch.batch["attention_mask"].sum(-1).tolist(), self.actor_dp))
        return batch, sampling_metrics

    def generate_and_score(self, batch_dict: dict, timings: dict[str, float]) -> DataProto:
        """Responses to a batch of prompts with `token_level_scores` (rule or reward model, plus
        DAPO's overlong penalty when enabled)."""
        batch = self.generate(DataProto.from_single_dict(batch_dict), timings)
        with metrics.timer("reward", timings):
            if self.roles.reward_model is not None:
                batch = batch.union(self.roles.reward_model.compute_rm_score(batch))
            batch = batch.union(compute_rewards(batch, self.tokenizer, self.reward_fn))
            overlong = self.cfg.algorithm.overlong_buffer
            if overlong.enable:
                limit = self.cfg.rollout.max_new_tokens(self.cfg.rollout.sampling)
                scores = batch.batch["token_level_scores"]
                batch.batch["token_level_scores"] = scores + core.overlong_scores(batch, overlong, limit)
        return batch

    def generate(self, batch: DataProto, timings: dict[str, float]) -> DataProto:
        """n responses per prompt (grouped by `uid`) and ReMax's greedy baseline when needed."""
        n = self.cfg.rollout.sampling.n
        batch.non_tensor_batch["uid"] = core.new_uids(len(batch))
        prompts = pop_prompts(batch, self.rollout_reads_rows)
        prompts.meta_info["n"] = 1  # the driver repeats the prompts itself
        with metrics.timer("gen", timings):
            responses = self.roles.actor_rollout.generate_sequences(prompts.repeat(n, interleave=True))
        baselines = None
        if self.cfg.algorithm.adv_estimator == "remax":
            with metrics.timer("gen_baseline", timings):
                baselines = self.greedy_baseline(prompts, batch).repeat_interleave(n)  # (B * n,)
        batch = batch.repeat(n, interleave=True).union(responses)
        if baselines is not None:
            batch.batch["reward_baselines"] = baselines
        return batch

    def update_models(self, batch: DataProto, timings: dict[str, float]) -> dict[str, float]:
        """Critic update, then the actor's once the critic's warm-up steps are over."""
        out = {}
        if self.roles.critic is not None:
            with metrics.timer("update_critic", timings):
                out.update(metrics.mean_worker_metrics(self.roles.critic.update_critic(batch)))
        if self.global_step > self.cfg.critic.warmup_steps:
            with metrics.timer("update_actor", timings):
                out.update(metrics.mean_worker_metrics(self.roles.actor_rollout.update_actor(batch)))
        return out

    def greedy_baseline(self, prompts: DataProto, batch: DataProto) -> torch.Tensor:
        """ReMax's baseline (B,): the reward of the greedy response to each prompt (the rollout's
        validation sampling, which the recipe check requires to be greedy), scored like the samples."""
        # B prompts need not split evenly over the data-parallel ranks (B * n responses do)
        meta = {"validate": True, "n": 1, DataProtoConfig.auto_padding_key: True}
        greedy_prompts = DataProto.from_dict(dict(prompts.batch.items()), meta_info=meta)
        greedy = self.roles.actor_rollout.generate_sequences(greedy_prompts)
        greedy.non_tensor_batch.update(batch.non_tensor_batch)
        if self.roles.reward_model is None:
            return sequence_scores(greedy, self.tokenizer, self.reward_fn)
        greedy.meta_info[DataProtoConfig.auto_padding_key] = True
        return self.roles.reward_model.compute_rm_score(greedy).batch["rm_scores"].sum(dim=-1)

    def validate(self) -> dict[str, float]:
        """One pass over the validation set (its loader is unshuffled: every pass is the same)."""
        rollout, rows = self.roles.actor_rollout, self.rollout_reads_rows
        return run_validation(rollout, self.val_loader, self.tokenizer, self.val_reward_fn, rows)

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self) -> Path:
        parts = ["actor", "trainer_state.pt"] + (["critic"] if self.roles.critic is not None else [])

        def write(directory: Path) -> None:
            self.roles.actor_rollout.save_checkpoint(str(directory / "actor"))
            if self.roles.critic is not None:
                self.roles.critic.save_checkpoint(str(directory / "critic"))
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
        self.roles.actor_rollout.load_checkpoint(str(point.part("actor")))
        if self.roles.critic is not None:
            self.roles.critic.load_checkpoint(str(point.part("critic")))
        restore_rng_state(state["rng"])
        self.train_loader.load_state_dict(state["dataloader"])
        self.kl_ctrl.value = state["extra"]["kl_coef"]
        self.skipped_steps = state["extra"].get("nonfinite_skipped_steps", 0)
        self.global_step = state["global_step"]
        print(f"resumed from {point.path} at step {self.global_step}", flush=True)
        return self.global_step
