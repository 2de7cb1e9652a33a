"""Settings of the Megatron-Core engine, named as Megatron-Core names them.

This module imports nothing from Megatron-Core so that the recipe schema can compose it
without pulling Megatron into `import hybridflow`. Choice fields are `Literal` types, so the
recipe loader (OmegaConf) rejects any other value with the key path and the valid ones.
"""

from dataclasses import dataclass, field
from typing import Any, Literal

from hybridflow.algorithms.kl import KL_PENALTY_KINDS
from hybridflow.algorithms.losses import LOSS_AGG_MODES
from hybridflow.algorithms.policy_losses import POLICY_LOSSES

# The valid values of each choice. model.DTYPES and checks.LR_DECAY_STYLES, which check values
# given to the engine directly, must equal these (tests/test_config.py checks).

ParamsDtype = Literal["float32", "bfloat16"]  # bf16 keeps fp32 master weights
OptimizerName = Literal["adam"]  # AdamW (decoupled weight decay)
LrDecayStyle = Literal["constant", "linear", "cosine"]
LossAggMode = Literal[LOSS_AGG_MODES]
KlPenaltyKind = Literal[KL_PENALTY_KINDS]
PolicyLoss = Literal[POLICY_LOSSES]
MoeTokenDispatcher = Literal["allgather", "alltoall"]
# off: the routers pick their own experts | rollout: the experts the rollout engine picked for each
# token (its routed_experts, rollout.return_routed_experts), replayed (engines/megatron/routing_replay.py)
MoeRoutingReplay = Literal["off", "rollout"]
# Megatron-Core's names of the linears a LoRA adapter can sit on (engines/megatron/lora.py), and
# the Hugging Face projections each covers: linear_qkv = q/k/v_proj, linear_proj = o_proj,
# linear_fc1 = gate/up_proj, linear_fc2 = down_proj.
LORA_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
LoraTarget = Literal[LORA_TARGETS]
# How the rollout engine gets the adapters: merged into the weights (any engine) or as a LoRA
# adapter loaded next to unchanged base weights (vLLM; docs/lora.md)
LoraSync = Literal["merged", "adapters"]
# ||dw|| / ||w|| of one optimizer step above which the step is refused. An Adam step moves each
# weight by about lr, so the ratio is about lr / rms(w): ~5e-5 for RL at lr 1e-6 on weights of rms
# 0.02; the quickstart's SFT warm start (lr 1e-3, tiny model) peaks at 0.007 (measured). A step
# that moves the weights by a quarter of their norm is a collapse, not learning.
MAX_UPDATE_RATIO = 0.25


@dataclass
class MegatronConfig:
    """Parallel layout, precision and memory placement of one Megatron-backed role."""

    tensor_model_parallel_size: int = 1  # TP: each layer's weights split over this many ranks
    pipeline_model_parallel_size: int = 1  # PP: the layers split into this many stages
    context_parallel_size: int = 1  # CP: each sequence split over this many ranks (Transformer Engine)
    sequence_parallel: bool = False  # Megatron's sequence parallelism over the TP ranks (Transformer Engine)
    # optimizer state sharded over the data-parallel ranks (GPU only; CPU runs use the numerically
    # equal local update)
    use_distributed_optimizer: bool = True
    params_dtype: ParamsDtype = "float32"  # the parameters' dtype
    make_vocab_size_divisible_by: int = 128  # the vocabulary is padded to a multiple of this x TP
    # Actor state in host memory while the rollout engine generates (engines/megatron/offload.py);
    # no-ops on CPU machines. Parameters leave once synced into the engine, gradients and
    # optimizer state before the engine's weights are resumed.
    param_offload: bool = False
    grad_offload: bool = False  # gradients in host memory while the engine generates
    optimizer_offload: bool = False  # optimizer state in host memory while the engine generates
    seed: int = 42  # seeds torch's and Megatron's model-parallel RNGs and a new value head's weights
    # Mixture-of-experts models only (Qwen3-MoE, Mixtral); ignored for dense models.
    expert_model_parallel_size: int = 1  # EP: experts split over this many ranks
    # ETP: each expert's weights split over this many ranks; None: Megatron's default, the dense TP size
    expert_tensor_parallel_size: int | None = None
    moe_aux_loss_coeff: float = 0.0  # router load-balancing loss weight (HF's router_aux_loss_coef)
    # how tokens reach their experts' ranks (allgather: Megatron's default)
    moe_token_dispatcher_type: MoeTokenDispatcher = "allgather"
    moe_routing_replay: MoeRoutingReplay = "off"  # R3: docs/routing-replay.md
    # Any other Megatron-Core 0.16.1 setting by its own name, applied over what hybridflow builds
    # (engines/megatron/passthrough.py): TransformerConfig fields, e.g. {recompute_granularity: full}
    transformer: dict[str, Any] = field(default_factory=dict)
    ddp: dict[str, Any] = field(default_factory=dict)  # DistributedDataParallelConfig fields, as transformer
    optimizer: dict[str, Any] = field(default_factory=dict)  # OptimizerConfig fields, as transformer

    def __post_init__(self) -> None:
        from engines.megatron.passthrough import check_megatron_passthrough

        check_megatron_passthrough(
            {"transformer": self.transformer, "ddp": self.ddp, "optimizer": self.optimizer}
        )


@dataclass
class LoraConfig:
    """LoRA adapters on the actor's linears (docs/lora.md): W x + alpha / rank * B A dropout(x),
    base weights frozen, only A and B trained. rank 0: off (full fine-tuning)."""

    rank: int = 0  # r, the adapters' inner dimension; 0: no adapters
    alpha: float = 16.0  # the update is scaled by alpha / rank (peft's default, not rsLoRA)
    dropout: float = 0.0  # dropout probability on the adapter's input (the base path has none)
    # the Megatron-Core linears that get adapters: linear_qkv (HF q/k/v_proj), linear_proj (o_proj),
    # linear_fc1 (gate/up_proj), linear_fc2 (down_proj)
    target_modules: list[LoraTarget] = field(default_factory=lambda: list(LORA_TARGETS))
    seed: int = 0  # draws A (peft's kaiming-uniform); B starts at zero, so step 0 is the base model
    sync: LoraSync = "merged"  # adapters: send only A and B each step (rollout.name=vllm)

    def __post_init__(self) -> None:
        validate_lora_config(self)


def validate_lora_config(lora: LoraConfig) -> None:
    """ValueError naming the key and the valid values (also for values set after loading)."""
    if lora.rank < 0:
        raise ValueError(f"actor.lora.rank must be >= 0 (0: no adapters), got {lora.rank}")
    if lora.rank and lora.alpha <= 0:
        raise ValueError(f"actor.lora.alpha must be positive, got {lora.alpha}")
    if not 0.0 <= lora.dropout < 1.0:
        raise ValueError(f"actor.lora.dropout must lie in [0, 1), got {lora.dropout}")
    unknown = [name for name in lora.target_modules if name not in LORA_TARGETS]
    if unknown:
        raise ValueError(
            f"actor.lora.target_modules: {unknown} are not Megatron-Core linear names; "
            f"choose from {list(LORA_TARGETS)}"
        )
    if lora.rank and not lora.target_modules:
        raise ValueError(
            f"actor.lora.target_modules is empty with actor.lora.rank={lora.rank}; name at least one"
        )
    if len(set(lora.target_modules)) != len(lora.target_modules):
        raise ValueError(f"actor.lora.target_modules lists a module twice: {list(lora.target_modules)}")


@dataclass
class OptimConfig:
    """Optimizer and LR schedule (Megatron-Core `OptimizerConfig` / `OptimizerParamScheduler` names)."""

    optimizer: OptimizerName = "adam"  # the optimizer
    lr: float = 1e-6  # the learning rate after warmup
    min_lr: float = 0.0  # the learning rate the decay ends at
    weight_decay: float = 0.01  # AdamW's decoupled weight decay
    adam_beta1: float = 0.9  # Adam's decay rate of the gradient's running mean
    adam_beta2: float = 0.999  # Adam's decay rate of the squared gradient's running mean
    adam_eps: float = 1e-8  # added to Adam's denominator
    clip_grad: float = 1.0  # gradients are scaled down to this global L2 norm when above it
    lr_warmup_iters: int = 0  # optimizer steps of linear warmup from 0 to lr
    lr_decay_iters: int | None = None  # the optimizer step at which lr reaches min_lr; None: no decay
    lr_decay_style: LrDecayStyle = "constant"  # the curve from lr to min_lr over lr_decay_iters
    # [lowest, highest] lr a recipe may set: one outside them (a typo such as 1e30, which trains to
    # garbage without any NaN) is refused when the recipe loads; widen them for a deliberate run.
    lr_limits: list[float] = field(default_factory=lambda: [1e-9, 1e-2])


@dataclass
class ActorUpdateConfig:
    """How `MegatronActor.update_policy` / `update_sft` consume a batch (verl's names).

    Batch sizes count sequences. `ppo_mini_batch_size` is global (all data-parallel ranks
    together; one optimizer step each), `ppo_micro_batch_size` is per rank (one forward/backward).
    """

    ppo_mini_batch_size: int = 8  # sequences per optimizer step, all data-parallel ranks together
    ppo_micro_batch_size: int = 2  # sequences per forward/backward, per data-parallel rank
    ppo_epochs: int = 1  # passes over each batch
    # PPO's clip: ratios below 1 - clip_ratio_low are clipped (cispo, gmpo, dppo_*: docs/algorithms.md)
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2  # ratios above 1 + clip_ratio_high are clipped; > clip_ratio_low: DAPO
    clip_ratio_c: float = 3.0  # dual-clip bound for negative advantages (dppo_*: the weight's cap)
    # how token losses average into the batch loss (hybridflow/algorithms/losses.py);
    # "seq-mean-token-sum-norm": Dr. GRPO
    loss_agg_mode: LossAggMode = "token-mean"
    entropy_coeff: float = 0.0  # entropy bonus weight (loss -= coeff * entropy)
    use_kl_loss: bool = False  # KL to the reference policy as a loss term (needs ref_log_prob)
    kl_loss_coef: float = 0.001  # weight of the KL loss term (use_kl_loss)
    # the per-token KL estimator (hybridflow/algorithms/kl.py, Schulman 2020): kl/k1 log r, abs |log r|,
    # mse/k2 (log r)^2 / 2, low_var_kl/k3 r^-1 - 1 + log r, with log r = log pi - log pi_ref
    kl_loss_type: KlPenaltyKind = "low_var_kl"
    shuffle: bool = False  # shuffle rows within this rank's shard before each epoch
    seed: int = 0  # seeds the shuffle
    # a registered loss (docs/algorithms.md: "vanilla" PPO, "gspo" with clip ratios near 3e-4 / 4e-4
    # and loss_agg_mode "seq-mean-token-mean", ...) or 'package.module.function', a loss of your own
    policy_loss: PolicyLoss | str = "vanilla"
    tau_pos: float = 1.0  # sapo: the soft gate's temperature for tokens with positive advantage
    tau_neg: float = 1.05  # sapo: the gate's temperature for the others (above tau_pos: the paper's)
    clip_cov_ratio: float = 0.0002  # clip_cov: the share of valid tokens whose gradient is dropped
    clip_cov_lb: float = 1.0  # clip_cov: only tokens whose covariance term exceeds this are candidates
    clip_cov_ub: float = 5.0  # clip_cov: ... and lies below this
    kl_cov_ratio: float = 0.0002  # kl_cov: the share of valid tokens (largest covariance) penalised
    ppo_kl_coef: float = 0.1  # kl_cov: weight of the |log(pi / pi_old)| penalty on those tokens
    dro_beta: float | None = None  # dro: weight of the (log(pi / pi_old))^2 / 2 penalty; required (> 0)
    # Sequence packing + token-budget micro-batches (docs/packing.md); also switches the actor's
    # log-prob and the reference's forward to packed micro-batches of their own budgets.
    use_dynamic_bsz: bool = False
    max_token_len_per_gpu: int = 8192  # tokens (prompt + response) per packed micro-batch, per rank
    # Collapse guard: an optimizer step that would change the weights by more than this fraction of
    # their norm (||dw|| / ||w||, predicted before the step) is not applied, and the run stops or
    # skips the step as trainer.nonfinite_policy says; null: not measured.
    max_update_ratio: float | None = MAX_UPDATE_RATIO


@dataclass
class CriticUpdateConfig:
    """How `MegatronCritic.update_critic` consumes a batch; sizes as in `ActorUpdateConfig`."""

    ppo_mini_batch_size: int = 8  # sequences per optimizer step, all data-parallel ranks together
    ppo_micro_batch_size: int = 2  # sequences per forward/backward, per data-parallel rank
    ppo_epochs: int = 1  # passes over each batch
    cliprange_value: float = 0.5  # value clipping: new values stay within this of the old ones in the loss
    loss_agg_mode: LossAggMode = "token-mean"  # how the value loss is averaged, as the actor's
    # Sequence packing + token-budget micro-batches for the update and the values (docs/packing.md).
    use_dynamic_bsz: bool = False
    max_token_len_per_gpu: int = 8192  # tokens (prompt + response) per packed micro-batch, per rank
    max_update_ratio: float | None = MAX_UPDATE_RATIO  # the collapse guard, as actor.update.max_update_ratio
