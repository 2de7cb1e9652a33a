"""Single-process checks of the training half's settings: LR schedule values, and bad settings
rejected with the key named before any model is built."""

from types import SimpleNamespace

import pytest
import torch

from engines.megatron.checkpoint import (
    distributed_optimizer_format,
    give_each_parameter_its_step,
    load_checkpoint,
    optimizer_reshard_problem,
)
from engines.megatron.checks import (
    validate_actor_update_config,
    validate_critic_update_config,
    validate_optim_config,
)
from engines.megatron.config import ActorUpdateConfig, CriticUpdateConfig, OptimConfig
from engines.megatron.optimizer import build_scheduler, current_lr


def _lrs(optim: OptimConfig, steps: int) -> list[float]:
    params = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=optim.lr)
    scheduler = build_scheduler(params, optim)
    lrs = []
    for _ in range(steps):
        lrs.append(current_lr(params))
        scheduler.step(1)
    return lrs


def test_warmup_then_linear_decay_by_hand():
    optim = OptimConfig(lr=1.0, min_lr=0.1, lr_warmup_iters=2, lr_decay_iters=6, lr_decay_style="linear")
    # warmup from 0: 0, .5, 1; then 1 - .9 * (step - 2) / 4; min_lr after step 6
    expected = [0.0, 0.5, 1.0, 0.775, 0.55, 0.325, 0.1, 0.1]
    assert _lrs(optim, 8) == pytest.approx(expected)


def test_constant_schedule_and_cosine():
    assert _lrs(OptimConfig(lr=0.3), 3) == pytest.approx([0.3] * 3)
    cosine = OptimConfig(lr=1.0, lr_decay_iters=4, lr_decay_style="cosine")
    # 0.5 * (cos(pi * step / 4) + 1)
    assert _lrs(cosine, 5) == pytest.approx([1.0, 0.853553, 0.5, 0.146447, 0.0], abs=1e-6)


@pytest.mark.parametrize(
    ("optim", "message"),
    [
        (OptimConfig(optimizer="sgd"), "optim.optimizer"),
        (OptimConfig(lr_decay_style="step"), "optim.lr_decay_style"),
        (OptimConfig(lr=1e-3, min_lr=1e-2), "optim.min_lr"),
        (OptimConfig(clip_grad=-1.0), "optim.clip_grad"),
        (OptimConfig(lr_decay_style="cosine"), "optim.lr_decay_iters"),
        (OptimConfig(lr_decay_style="linear", lr_warmup_iters=5, lr_decay_iters=5), "optim.lr_decay_iters"),
    ],
)
def test_bad_optim_settings_are_named(optim, message):
    with pytest.raises(ValueError, match=message):
        validate_optim_config(optim)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"ppo_epochs": 0}, "ppo_epochs"),
        ({"loss_agg_mode": "sum"}, "loss_agg_mode"),
        ({"kl_loss_type": "full"}, "kl_loss_type"),
        ({"clip_ratio_c": 1.0}, "clip_ratio_c"),
    ],
)
def test_bad_actor_update_settings_are_named(overrides, message):
    with pytest.raises(ValueError, match=message):
        validate_actor_update_config(ActorUpdateConfig(**overrides))


def test_bad_critic_update_settings_are_named():
    with pytest.raises(ValueError, match="cliprange_value"):
        validate_critic_update_config(CriticUpdateConfig(cliprange_value=0.0))
    with pytest.raises(ValueError, match="ppo_micro_batch_size"):
        validate_critic_update_config(CriticUpdateConfig(ppo_micro_batch_size=0))


def test_loading_a_directory_that_is_no_checkpoint_fails_clearly(tmp_path):
    with pytest.raises(ValueError, match="not a Megatron distributed checkpoint"):
        load_checkpoint([], None, None, tmp_path)


def test_distributed_optimizer_checkpoints_reshard_except_over_torch_adam():
    """Megatron-Core 0.16.1 loads fully_reshardable only without torch Adam's per-parameter step
    (seen on an H200): with torch Adam, dp_reshardable, and a TP/PP change is refused by name."""
    assert distributed_optimizer_format(torch_adam=False) == "fully_reshardable"
    assert distributed_optimizer_format(torch_adam=True) == "dp_reshardable"
    tp2, tp1, tp2_dp2 = dict(tp=2, pp=1, dp=1), dict(tp=1, pp=1, dp=2), dict(tp=2, pp=1, dp=2)
    problem = optimizer_reshard_problem("dp_reshardable", tp2, tp1)
    assert "saved at TP 2 x PP 1" in problem and "tensor_model_parallel_size=2" in problem
    assert optimizer_reshard_problem("dp_reshardable", tp2, tp2_dp2) is None  # DP may change
    assert optimizer_reshard_problem("fully_reshardable", tp2, tp1) is None
    assert optimizer_reshard_problem(None, tp2, tp1) is None  # not the distributed optimizer (CPU)


def test_a_step_shared_by_every_parameter_after_a_load_is_split():
    """The state Megatron-Core's DistributedOptimizer loads without TE/apex: one `step` tensor for
    every parameter. torch's AdamW then counts a step once per parameter; split, once in all."""

    def adam_after_shared_load():
        params = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))]
        adam = torch.optim.AdamW(params, lr=0.1)
        step = torch.tensor(1.0)
        state = {i: {"step": step, "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
                 for i, p in enumerate(params)}  # fmt: skip
        adam.load_state_dict({"state": state, "param_groups": adam.state_dict()["param_groups"]})
        for param in params:
            param.grad = torch.ones_like(param)
        return adam

    shared = adam_after_shared_load()
    shared.step()
    assert [s["step"].item() for s in shared.state.values()] == [3.0, 3.0]  # torch counted twice
    split = adam_after_shared_load()
    give_each_parameter_its_step(SimpleNamespace(optimizer=split))
    split.step()
    assert [s["step"].item() for s in split.state.values()] == [2.0, 2.0]


def test_mini_batches_cover_every_row_once_per_epoch():
    from engines.megatron.training import mini_batches
    from hybridflow.protocol import DataProto

    data = DataProto.from_dict(tensors={"row": torch.arange(6)})
    plain = [b.batch["row"].tolist() for b in mini_batches(data, 2, epochs=1, shuffle=False, seed=0)]
    assert plain == [[0, 1], [2, 3], [4, 5]]
    shuffled = [b.batch["row"].tolist() for b in mini_batches(data, 3, epochs=2, shuffle=True, seed=0)]
    epochs = [shuffled[0] + shuffled[1], shuffled[2] + shuffled[3]]
    assert all(sorted(e) == list(range(6)) for e in epochs)
    assert epochs[0] != epochs[1] and epochs[0] != list(range(6))
