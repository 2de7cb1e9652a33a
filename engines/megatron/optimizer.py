"""Optimizer and learning-rate schedule of a Megatron-backed trainable role.

`build_optimizer(chunks, optim, cfg)` returns `(optimizer, scheduler)`:
- with CUDA, Megatron-Core's own `get_megatron_optimizer` (distributed optimizer when
  `cfg.use_distributed_optimizer`; bf16 params keep fp32 master weights);
- on CPU, `CpuFP32Optimizer`, Megatron-Core's `FP32Optimizer` over torch AdamW with the CUDA-only
  parts of gradient clipping done in plain torch (see the class for why and what is equal).
Both use Megatron-Core's parameter groups (no weight decay on biases and 1-D parameters) and
Megatron-Core's `OptimizerParamScheduler` for LR warmup / decay, so a CPU step and a GPU fp32
step apply the same update.
"""

import math

import torch
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer import _get_param_groups as megatron_param_groups
from megatron.core.optimizer.optimizer import FP32Optimizer, MegatronOptimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from engines.megatron.checks import validate_optim_config
from engines.megatron.config import MegatronConfig, OptimConfig
from engines.megatron.model import params_dtype


def megatron_optimizer_config(optim: OptimConfig, cfg: MegatronConfig) -> OptimizerConfig:
    """Megatron-Core's `OptimizerConfig` for these settings and `cfg.optimizer`'s pass-through fields."""
    dtype = params_dtype(cfg)
    settings = dict(
        optimizer=optim.optimizer,
        lr=optim.lr,
        min_lr=optim.min_lr,
        weight_decay=optim.weight_decay,
        adam_beta1=optim.adam_beta1,
        adam_beta2=optim.adam_beta2,
        adam_eps=optim.adam_eps,
        clip_grad=optim.clip_grad,
        bf16=dtype == torch.bfloat16,
        params_dtype=dtype,
        use_distributed_optimizer=cfg.use_distributed_optimizer and torch.cuda.is_available(),
    )
    return OptimizerConfig(**{**settings, **cfg.optimizer})  # the recipe's pass-through wins


class CpuFP32Optimizer(FP32Optimizer):
    """Megatron-Core's `FP32Optimizer` with gradient clipping that runs on CPU tensors.

    Why it differs: Megatron-Core's clipping asserts `param.grad.type() ==
    'torch.cuda.FloatTensor'` and allocates its buffers with `device='cuda'`, and
    `FP32Optimizer.__init__` puts its loss scale on CUDA. The distributed optimizer refuses CPU
    tensors outright; it only shards optimizer state over data-parallel ranks, so the
    non-distributed update is numerically the same.

    What is the same: the inner optimizer is torch AdamW (decoupled weight decay, as Megatron-Core
    builds it without Transformer Engine / Apex), the parameter groups and the main-grad copy are
    Megatron-Core's, and the norm is Megatron-Core's: the squared L2 norms of
    `get_main_grads_for_grad_norm()` (which skips shared parameters and counts
    tensor-parallel duplicates such as layernorm weights once) summed, all-reduced over the
    model-parallel group, square-rooted; gradients are scaled by clip / (norm + 1e-6) when that
    is below one. Checkpointing uses `FP32Optimizer.sharded_state_dict` unchanged.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, config: OptimizerConfig, init_state_fn):
        MegatronOptimizer.__init__(self, optimizer, config, init_state_fn)
        self._scale = torch.ones(1)
        self.is_stub_optimizer = optimizer is None

    @torch.no_grad()
    def get_grad_norm(self) -> float:
        squares = torch.zeros(1, dtype=torch.float32)
        for grad in self.get_main_grads_for_grad_norm():
            squares += grad.float().square().sum()
        torch.distributed.all_reduce(squares, group=self.get_grad_stats_parallel_group())
        return squares.sqrt().item()

    @torch.no_grad()
    def clip_grad_norm(self, clip_grad: float) -> float:
        grad_norm = self.get_grad_norm()
        clip_coeff = clip_grad / (grad_norm + 1.0e-6)
        if clip_coeff < 1.0:
            for param in self.get_parameters():
                if param.grad is not None:
                    param.grad.mul_(clip_coeff)
        return grad_norm


def _init_adam_state(optimizer: torch.optim.Optimizer, config=None) -> None:
    """Create zero Adam moments so a sharded state dict can be built before the first step."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            if len(optimizer.state[param]) == 0:
                optimizer.state[param]["exp_avg"] = torch.zeros_like(param.data)
                optimizer.state[param]["exp_avg_sq"] = torch.zeros_like(param.data)


def _build_cpu_optimizer(chunks: list, config: OptimizerConfig) -> CpuFP32Optimizer:
    param_groups = megatron_param_groups(chunks, config, None)  # the same groups on every rank
    adamw = torch.optim.AdamW(
        param_groups,
        lr=config.lr,
        weight_decay=config.weight_decay,
        betas=(config.adam_beta1, config.adam_beta2),
        eps=config.adam_eps,
    )
    return CpuFP32Optimizer(adamw, config, _init_adam_state)


def build_scheduler(optimizer, optim: OptimConfig) -> OptimizerParamScheduler:
    """Megatron-Core's LR schedule: linear warmup from 0 over `lr_warmup_iters` steps, then
    constant / linear / cosine decay to `min_lr` at `lr_decay_iters`; one step per update."""
    # The scheduler asserts warmup < decay steps even when the style is constant.
    decay_iters = optim.lr_decay_iters or optim.lr_warmup_iters + 1
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=optim.lr,
        min_lr=optim.min_lr,
        lr_warmup_steps=optim.lr_warmup_iters,
        lr_decay_steps=decay_iters,
        lr_decay_style=optim.lr_decay_style,
        start_wd=optim.weight_decay,
        end_wd=optim.weight_decay,
        wd_incr_steps=1,
        wd_incr_style="constant",
    )


def build_optimizer(chunks: list, optim: OptimConfig, cfg: MegatronConfig):
    """(optimizer, scheduler) for the DDP-wrapped model chunks of this rank."""
    validate_optim_config(optim)
    config = megatron_optimizer_config(optim, cfg)
    if torch.cuda.is_available():
        optimizer = get_megatron_optimizer(config, chunks)
    elif cfg.params_dtype != "float32":
        raise ValueError(
            f"params_dtype={cfg.params_dtype!r} training needs CUDA; CPU runs train in 'float32'"
        )
    else:
        optimizer = _build_cpu_optimizer(chunks, config)
    return optimizer, build_scheduler(optimizer, optim)


# Elements handled at once when predicting an update: bounds the temporaries for a large tensor
# (an embedding of 150k x 8k) to a few of these instead of a few copies of the tensor.
UPDATE_CHUNK = 1 << 24


def adamw_delta(param, grad, exp_avg, exp_avg_sq, step: int, group: dict) -> torch.Tensor:
    """The change AdamW's next step makes to `param` (flat, chunk-sized tensors of one parameter),
    without touching them: torch.optim.AdamW's update (decoupled weight decay, bias correction)
    with the moments this step would leave. `step`: steps taken so far."""
    beta1, beta2 = group["betas"]
    lr, eps, t = group["lr"], group["eps"], step + 1
    exp_avg = torch.lerp(exp_avg, grad, 1 - beta1)  # (n,)
    exp_avg_sq = exp_avg_sq * beta2 + grad * grad * (1 - beta2)  # (n,)
    denom = exp_avg_sq.sqrt() / (1 - beta2**t) ** 0.5 + eps  # (n,)
    return -lr * group["weight_decay"] * param - lr / (1 - beta1**t) * exp_avg / denom  # (n,)


def _steps_taken(state: dict, group: dict) -> int:
    """Adam steps taken so far: torch keeps the count per parameter, Apex's FusedAdam per group."""
    step = state.get("step", group.get("step", 0))
    return int(step.item() if torch.is_tensor(step) else step)


def _counted_parameters(optimizer):
    """(param, its group) for the parameters Megatron-Core counts in the grad norm: with a
    gradient, not shared, not a tensor-parallel duplicate (each element counted once)."""
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate as not_duplicate
    from megatron.core.transformer.module import param_is_not_shared

    for group in optimizer.param_groups:
        for param in group["params"]:
            if param.grad is not None and param_is_not_shared(param) and not_duplicate(param):
                yield param, group


def _update_squares(param, group: dict, state: dict, grad_scale: float) -> torch.Tensor:
    """(||dw||^2, ||w||^2) of one parameter's predicted AdamW step, in float64, chunk by chunk."""
    zero = torch.zeros_like(param)
    tensors = (param, param.grad, state.get("exp_avg", zero), state.get("exp_avg_sq", zero))
    chunks = [t.reshape(-1).split(UPDATE_CHUNK) for t in tensors]
    steps = _steps_taken(state, group)
    squares = torch.zeros(2, dtype=torch.float64, device=param.device)
    for w, g, m, v in zip(*chunks, strict=True):
        delta = adamw_delta(w.float(), g.float() * grad_scale, m.float(), v.float(), steps, group)  # (n,)
        squares += torch.stack([delta.double().square().sum(), w.double().square().sum()])
    return squares


def _reduced_squares(optimizer, grad_scale: float) -> torch.Tensor:
    """`_update_squares` summed over one Megatron optimizer's counted parameters on every rank."""
    state = optimizer.optimizer.state
    parts = [_update_squares(p, g, state[p], grad_scale) for p, g in _counted_parameters(optimizer)]
    squares = torch.stack(parts).sum(dim=0) if parts else torch.zeros(2, dtype=torch.float64)
    if torch.cuda.is_available():  # NCCL reduces device tensors only
        squares = squares.cuda()
    torch.distributed.all_reduce(squares, group=optimizer.get_grad_stats_parallel_group())
    return squares.cpu()


@torch.no_grad()
def update_to_weight_ratio(optimizer, grad_norm: float) -> float:
    """||dw|| / ||w|| of the step `optimizer.step()` is about to take, predicted from the
    gradients (after prepare_grads), the Adam moments and each group's lr and weight decay, with
    the clipping the step applies (`clip_grad / (grad_norm + 1e-6)` when below one, as Megatron-
    Core clips). Summed like the grad norm: each rank's counted parameters, all-reduced over each
    optimizer's grad-stats group (a ChainedOptimizer's parts: dense and expert parameters), so
    every rank decides the same. Nothing is changed."""
    clip = optimizer.config.clip_grad
    scale = min(1.0, clip / (grad_norm + 1.0e-6)) if clip > 0 else 1.0
    delta_sq, weight_sq = sum(_reduced_squares(part, scale) for part in inner_optimizers(optimizer)).tolist()
    if weight_sq == 0:
        return math.inf if delta_sq > 0 else 0.0
    return math.sqrt(delta_sq / weight_sq)


def inner_optimizers(optimizer) -> list:
    """A ChainedOptimizer's parts (dense and expert parameters), or the optimizer itself."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def current_lr(optimizer) -> float:
    """The learning rate of the default parameter group (what Megatron-Core logs)."""
    for group in optimizer.param_groups:
        if group.get("default_config", True):
            return float(group["lr"])
    return float(optimizer.param_groups[0]["lr"])
