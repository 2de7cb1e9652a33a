"""The recipe schema: typed dataclasses whose defaults are documented; a recipe states only what
differs. Engine settings are the engines' own config classes (Megatron-Core and SGLang names).

Top level: model, data, actor, ref, teacher, rollout, critic, reward_model, reward, algorithm, trainer.
`load_recipe` (loader.py) fills these from YAML plus `key.path=value` overrides.

Choice fields are `Literal` types built from the tuple the code dispatches on (the estimator
table, the KL estimators, the tracking backends), so each list of valid values is written once
and OmegaConf rejects any other value when the recipe loads, naming the key.
"""

from dataclasses import dataclass, field
from typing import Literal

from omegaconf import MISSING

from engines.megatron.config import (
    ActorUpdateConfig,
    CriticUpdateConfig,
    KlPenaltyKind,
    LoraConfig,
    MegatronConfig,
    OptimConfig,
)
from engines.rollout.config import RolloutConfig
from hybridflow.algorithms.advantages import ADVANTAGE_ESTIMATORS
from hybridflow.algorithms.distillation import DISTILL_KL_ESTIMATORS
from hybridflow.algorithms.rollout_correction import RolloutCorrectionConfig
from hybridflow.utils.tracking import BACKENDS

AdvEstimator = Literal[tuple(ADVANTAGE_ESTIMATORS)]
LoggerBackend = Literal[BACKENDS]
DistillKLEstimator = Literal[DISTILL_KL_ESTIMATORS]


@dataclass
class ModelConfig:
    """The policy: a local Hugging Face directory (config.json, weights, tokenizer) or a Hub id."""

    path: str = MISSING  # the policy: a local Hugging Face directory or a Hub id
    tokenizer_path: str | None = None  # a tokenizer's directory or Hub id; None: the one in `path`
    # `path` and `tokenizer_path` may also be Hugging Face Hub ids (hybridflow/utils/hub.py);
    # this is the Hub branch, tag or commit they resolve at (None: the default branch)
    revision: str | None = None


@dataclass
class DataConfig:
    """Prompt parquet files (rows as scripts/prepare_gsm8k.py writes them) and batching."""

    train_files: list[str] = MISSING  # training prompts: parquet files, read in order
    val_files: list[str] = field(default_factory=list)  # validation prompts: parquet files
    prompt_key: str = "prompt"  # the column holding each row's prompt (chat messages)
    max_prompt_length: int = 512  # longer prompts are dropped (and counted) when the data loads
    train_batch_size: int = 256  # prompts per step; each gets rollout.sampling.n responses
    val_batch_size: int | None = None  # prompts per validation batch; None: the whole set in one
    train_max_samples: int | None = None  # training rows used; None: every row, an int: the first rows
    val_max_samples: int | None = None  # as train_max_samples, for the validation files
    shuffle: bool = True  # shuffle the training prompts each epoch (validation keeps file order)
    seed: int = 1  # seeds the shuffle (epoch e is shuffled with seed + e)


@dataclass
class ActorConfig:
    """The trained policy: Megatron layout, optimizer and PPO update settings."""

    megatron: MegatronConfig = field(default_factory=MegatronConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    update: ActorUpdateConfig = field(default_factory=ActorUpdateConfig)
    # LoRA adapters instead of full fine-tuning (rank > 0; docs/lora.md)
    lora: LoraConfig = field(default_factory=LoraConfig)
    # A vision-language policy's vision tower keeps its weights (most RL recipes do); false trains it
    freeze_vision_tower: bool = True
    log_prob_micro_batch_size: int = 8  # per data-parallel rank, when recomputing old log-probs
    # With actor.update.use_dynamic_bsz: packed log-prob micro-batches of at most this many tokens
    # (prompt + response) per rank instead of log_prob_micro_batch_size rows (docs/packing.md).
    log_prob_max_token_len_per_gpu: int = 16384


@dataclass
class RefConfig:
    """The frozen reference policy (built from model.path with the actor's layout); it runs only
    when KL is used (algorithm.use_kl_in_reward or actor.update.use_kl_loss)."""

    log_prob_micro_batch_size: int = 8  # rows per forward of the reference, per data-parallel rank
    # With actor.update.use_dynamic_bsz: packed micro-batches of at most this many tokens per rank.
    log_prob_max_token_len_per_gpu: int = 16384


@dataclass
class TeacherConfig:
    """The frozen teacher of on-policy distillation (algorithm.distillation, docs/distillation.md):
    any Hugging Face checkpoint whose tokenizer is the student's (same vocabulary and special ids),
    a local directory or a Hub id, with its own Megatron layout. It scores the student's responses
    at the rollout temperature, like the reference."""

    path: str | None = None  # the teacher: a local Hugging Face directory or a Hub id
    megatron: MegatronConfig = field(default_factory=MegatronConfig)
    # 0: in the actor's processes (then its parallel sizes must equal actor.megatron's); >0: a pool
    # of its own of this many devices per node (counted in trainer.n_gpus_per_node), any layout
    n_gpus_per_node: int = 0
    log_prob_micro_batch_size: int = 8  # per data-parallel rank of the teacher
    # With actor.update.use_dynamic_bsz: packed micro-batches of at most this many tokens per rank.
    log_prob_max_token_len_per_gpu: int = 16384


@dataclass
class CriticConfig:
    """The value model for GAE, initialised from `model_path` with a fresh scalar value head."""

    enable: bool = False  # train a value model: algorithm.adv_estimator=gae needs it, the others refuse it
    model_path: str | None = None  # the critic's starting weights (a model directory); None: model.path
    megatron: MegatronConfig = field(default_factory=MegatronConfig)
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    update: CriticUpdateConfig = field(default_factory=CriticUpdateConfig)
    warmup_steps: int = 0  # steps that update only the critic before the actor starts learning
    n_gpus_per_node: int = 0  # 0: colocated with the actor; >0: its own pool of this many per node
    # With critic.update.use_dynamic_bsz: packed compute_values micro-batches of at most this many
    # tokens per rank (the update uses critic.update.max_token_len_per_gpu).
    forward_max_token_len_per_gpu: int = 16384


@dataclass
class RewardModelConfig:
    """A learned reward model: a value-style Megatron model scored at the last real token.
    It shares the policy's tokenizer."""

    enable: bool = False  # score responses with this model; its scores replace the rule reward
    path: str | None = None  # a Hugging Face model directory (required with enable)
    megatron: MegatronConfig = field(default_factory=MegatronConfig)
    micro_batch_size: int = 8  # rows per scoring forward, per data-parallel rank
    # Packed scoring micro-batches of at most forward_max_token_len_per_gpu tokens per rank
    # instead of micro_batch_size rows (docs/packing.md).
    use_dynamic_bsz: bool = False
    forward_max_token_len_per_gpu: int = 16384  # tokens (prompt + response) per packed micro-batch


@dataclass
class RewardConfig:
    """The rule reward: chosen by each row's data_source, or a user function."""

    custom_fn: str | None = (
        None  # "package.module.fn" taking (data_source, solution_str, ground_truth, extra_info)
    )
    format_score: float = 0.0  # reward of a well-formatted but wrong answer


@dataclass
class KLControlConfig:
    """KL coefficient for KL-in-reward: fixed, or adaptive (Ziegler et al. 2019)."""

    type: Literal["fixed", "adaptive"] = "fixed"  # adaptive: kl_coef moves to keep the KL near target_kl
    kl_coef: float = 0.001  # beta, the weight of the KL in the reward (the starting value if adaptive)
    target_kl: float = 0.1  # adaptive only
    horizon: int = 10000  # adaptive only


@dataclass
class FilterGroupsConfig:
    """DAPO's dynamic sampling (Yu et al. 2025): drop prompt groups whose responses all scored the
    same and generate more prompts until data.train_batch_size groups remain."""

    enable: bool = False  # keep only groups whose rewards differ (they carry a learning signal)
    max_num_gen_batches: int = 10  # generation rounds per step before the run stops with an error


@dataclass
class OverlongBufferConfig:
    """DAPO's overlong reward shaping: a penalty falling linearly from 0 to -penalty_factor over the
    last `length` tokens before the response limit (rollout max_new_tokens / response_length)."""

    enable: bool = False  # add the penalty to the reward of responses that reach the soft zone
    length: int = 0  # L_cache: tokens of the soft zone before the limit
    penalty_factor: float = 1.0  # the penalty of a response that reaches the limit


@dataclass
class DistillationConfig:
    """On-policy distillation (hybridflow/algorithms/distillation.py): the per-token reverse KL to
    the teacher (section `teacher`) as a negative advantage, A = task_coef * A_task - kl_coef * KL."""

    enable: bool = False  # score responses with the teacher and train toward it (needs teacher.path)
    kl_coef: float = 1.0  # weight of the per-token reverse KL in the advantage
    task_coef: float = 0.0  # 0: pure distillation; > 0 mixes in the estimator's task advantage
    # k1: log pi_s - log pi_t (its gradient is the reverse KL's) | k3: never negative, lower variance
    # (hybridflow/algorithms/distillation.py)
    kl_estimator: DistillKLEstimator = "k1"


@dataclass
class AlgorithmConfig:
    """How advantages are estimated and whether KL enters the reward."""

    # a registered estimator (docs/algorithms.md; gae needs critic.enable) or 'package.module.function',
    # an estimator of your own
    adv_estimator: AdvEstimator | str = "grpo"
    gamma: float = 1.0  # discount of future rewards (gae, reinforce_plus_plus)
    lam: float = 1.0  # GAE's lambda: 1 uses the full returns, lower trusts the values more
    norm_adv_by_std_in_grpo: bool = True  # False: Dr. GRPO (mean-centred only)
    pass_k: int | None = None  # grpo_passk: the k of pass@k, 1 <= k <= rollout.sampling.n; required there
    use_kl_in_reward: bool = False  # subtract kl_ctrl's beta x the per-token KL to `ref` from the reward
    kl_penalty: KlPenaltyKind = "kl"  # estimator of the KL in the reward: kl/k1, abs, mse/k2, low_var_kl/k3
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)  # DAPO dynamic sampling
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)  # DAPO
    distillation: DistillationConfig = field(default_factory=DistillationConfig)  # needs `teacher`
    # weights on the policy loss for samples of another policy (the engine's, an older version's)
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)


# colocated: the rollout engine shares the actor's processes and devices (the hybrid engine) |
# disaggregated: the rollout engines run on their own pool (trainer.rollout_pool), weights arrive
# over a process group after each update (docs/async.md)
Placement = Literal["colocated", "disaggregated"]
# sync: generate, then train (YAML reads a bare `off` as false, hence the name) | one_step: batch
# k+1 is generated with the weights of step k while the actor trains on batch k | async: a rollout
# loop keeps a bounded queue full, samples at most max_staleness versions old | stream: each prompt's
# group generates on its own as slots free up, a step trains the next finished groups
AsyncMode = Literal["sync", "one_step", "async", "stream"]
# stream: a finished group staler than max_staleness is dropped (its prompt skipped) | regenerated
# (its prompt submitted again with the newest weights); either way counted, never trained
StaleGroups = Literal["drop", "regenerate"]


@dataclass
class RolloutPoolConfig:
    """The rollout engines' own devices with trainer.placement=disaggregated (verl's layout: a pool
    beside the trainer's nnodes x n_gpus_per_node); on CPU machines, processes."""

    nnodes: int = 1  # nodes of the rollout pool
    n_gpus_per_node: int = 0  # 0: no pool (colocated placement)


@dataclass
class AsyncTrainingConfig:
    """How generation overlaps training (docs/async.md). Staleness of a sample: the policy version
    it is trained on minus the version its oldest token was generated with."""

    mode: AsyncMode = "sync"  # how generation overlaps training
    max_staleness: int = 1  # async, stream: the bound on a trained sample's staleness; one_step is 1
    partial_rollout: bool = False  # async, vllm: in-flight requests continue with new weights, tokens kept
    stale_groups: StaleGroups = "drop"  # stream only
    sync_every: int = 1  # one_step, async, stream: updates between weight transfers to the rollout engines

    def batches_ahead(self) -> int:
        """async, stream: batches generating ahead of the one trained. The engines serve weights up
        to sync_every - 1 updates old, so that lag plus the batches ahead stays within max_staleness."""
        return self.max_staleness - (self.sync_every - 1)

    def groups_outstanding(self, train_batch_size: int) -> int:
        """stream: groups generating or finished and not yet trained, at most, while a step waits
        for its own (AReaL's bound: taken in order, none would be staler than max_staleness)."""
        return (self.batches_ahead() + 1) * train_batch_size


@dataclass
class TrainerConfig:
    """The run: devices, length, validation, checkpoints, logging and output."""

    mode: Literal["rl", "sft"] = "rl"  # rl: the PPO-family loop | sft: supervised warm start (trainer/sft.py)
    project_name: str = "hybridflow"  # the wandb project
    experiment_name: str = "run"  # the wandb run name
    output_dir: str = "outputs/run"  # checkpoints, metrics.jsonl, plots and the resolved recipe
    nnodes: int = 1  # nodes of the trainer's pool
    n_gpus_per_node: int = 8  # devices per node; on CPU machines, worker processes per node
    use_gpu: bool = True  # false: run on CPU (n_gpus_per_node counts processes); true needs CUDA
    total_epochs: int = 1  # passes over data.train_files, when total_training_steps is null
    total_training_steps: int | None = None  # steps to train; None: total_epochs passes over the data
    test_freq: int = 0  # validate every this many steps (0: never)
    val_before_train: bool = False  # validate once before the first step (needs data.val_files)
    save_freq: int = 0  # checkpoint every this many steps and after the last one (0: never)
    max_ckpt_to_keep: int | None = None  # the newest checkpoints kept, older ones deleted; None: all
    resume_mode: Literal["auto", "disable"] = "auto"  # auto: continue from <output_dir>/checkpoints/latest
    resume_from_path: str | None = None  # a global_step_N directory to continue from (overrides auto)
    # where metrics go besides <output_dir>/metrics.jsonl (always written): a console line, a progress
    # bar, TensorBoard, Weights & Biases, PNG plots (hybridflow/utils/tracking.py)
    logger: list[LoggerBackend] = field(default_factory=lambda: ["console", "progress", "plots"])
    balance_batch: bool = True  # reorder each batch so every DP rank gets a similar token count
    export_hf: bool = False  # write the final actor as a Hugging Face checkpoint to <output_dir>/hf
    # NaN / inf reward, loss or grad norm, or an update over <role>.update.max_update_ratio: "error"
    # stops the run before the optimizer step (no checkpoint, no export) | "skip" drops the step's
    # update and counts it (nonfinite/skipped_steps)
    nonfinite_policy: Literal["error", "skip"] = "error"
    # the train-inference mismatch monitor (hybridflow/trainer/mismatch.py; reads the engine's log-probs,
    # rollout.calculate_log_probs): a step whose mismatch/kl_k3 exceeds mismatch_threshold "warn"s on
    # the console | "stop"s the run before its update, naming the metric and the step (no checkpoint)
    mismatch_policy: Literal["warn", "stop"] = "warn"
    mismatch_threshold: float = 0.1  # per-token k3 estimate of KL(engine || actor), mean over the batch
    mismatch_token_threshold: float = 0.5  # |log-prob difference| counted in mismatch/tokens_over_threshold
    # recipe keys that may differ from the resumed checkpoint's although they move the data
    # position or change the update (hybridflow.trainer.resume.POSITION_AND_UPDATE_KEYS)
    resume_accept_changes: list[str] = field(default_factory=list)
    # a worker process that dies (Ray's word: killed, out of memory, a lost node) stops every worker
    # group, starts them again and resumes from the newest complete checkpoint, up to this many
    # times a run (hybridflow/trainer/restart.py); 0: the run stops with one error line
    restart_on_failure: int = 0
    # seconds a call on the workers (an update, a log-prob pass, a checkpoint) may run before the
    # run stops with an error naming the rank and the call: a hung worker never blocks forever
    worker_call_timeout_s: float = 3600.0
    placement: Placement = "colocated"  # where the rollout engines run
    rollout_pool: RolloutPoolConfig = field(default_factory=RolloutPoolConfig)
    async_training: AsyncTrainingConfig = field(default_factory=AsyncTrainingConfig)


@dataclass
class RecipeConfig:
    """A whole run. `actor`, `rollout` and `ref` are colocated in one worker per device."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    ref: RefConfig = field(default_factory=RefConfig)
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
