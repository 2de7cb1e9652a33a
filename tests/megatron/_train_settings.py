"""Update settings shared by the training-parity workers (_train_parity.py) and the test's
single-process transformers reference (test_train_parity.py). Imports nothing heavy."""

import dataclasses

from engines.megatron.config import CriticUpdateConfig, OptimConfig

# adam_eps 1e-6, not 1e-8: Adam's first step is ~lr * sign(grad), so gradients that are zero up
# to rounding (k_proj biases: softmax ignores a shift shared by all keys) would otherwise move
# by +-lr depending on the summation order, which differs between layouts.
OPTIM = OptimConfig(
    lr=1e-3, weight_decay=0.1, clip_grad=0.3, lr_decay_iters=10, lr_decay_style="linear", adam_eps=1e-6
)
ACTOR_UPDATE = dict(
    ppo_mini_batch_size=8,
    ppo_micro_batch_size=2,
    ppo_epochs=2,
    clip_ratio_low=0.2,
    clip_ratio_high=0.28,
    clip_ratio_c=3.0,
    entropy_coeff=0.01,
    use_kl_loss=True,
    kl_loss_coef=0.1,
    kl_loss_type="low_var_kl",
)
CRITIC_UPDATE = CriticUpdateConfig(
    ppo_mini_batch_size=8, ppo_micro_batch_size=2, ppo_epochs=2, cliprange_value=0.2
)
TEMPERATURE = 0.9
# The packed-vs-padded updates on the heavy batch compare two fp32 summation orders. Adam moves a
# weight by lr * g / (|g| + eps): where g is near 0, a 1e-8 rounding difference in g becomes
# lr / eps * 1e-8 = 1e-5 of weight at eps 1e-6. eps 1e-4 keeps that 100x below the tolerance;
# the gradients themselves are compared directly (the `packing` step).
HEAVY_OPTIM = dataclasses.replace(OPTIM, adam_eps=1e-4)
# Token budget of the packed micro-batches on the heavy-tailed batch (its longest row has 38
# tokens): several micro-batches of unequal row counts per rank.
PACKED_BUDGET = 40
SFT_STEPS = 6
