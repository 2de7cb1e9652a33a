"""A one-process GRPO run of recipes/quickstart.yaml on the tiny model (scripts/gpu_check.py's path:
LocalWorkerGroup, the Megatron actor, the hf rollout, PPOTrainer.fit) under
trainer.mismatch_policy=stop, whose rollout engine is corrupted from the second step on: after the
real sync, the engine loads a noised copy of every weight through its own `update_weights` (what
a sync that sent wrong tensors would do). Step 1 must train and log the monitor's metrics; step 2
must stop before its update with the trainer's `error:` line. Prints that line as main() does,
then the policy's version (the number of updates applied).

    python tests/_mismatch_stop_run.py WORKDIR
"""

import os
import sys
from pathlib import Path

import torch

from engines.rollout.hf_rollout import checkpoint_tensors
from hybridflow.data.arith import ArithConfig, write_arith_parquet
from hybridflow.single_controller import LocalWorkerGroup, RayClassWithInitArgs
from hybridflow.trainer.main import RUN_STOPPING_ERRORS, prepare, stopped
from hybridflow.trainer.policy import Policy
from hybridflow.trainer.ppo_trainer import PPOTrainer
from hybridflow.trainer.roles import Roles
from hybridflow.trainer.rollout.colocated import ColocatedRollout
from hybridflow.utils.tiny_model import make_tiny_model
from hybridflow.workers.hybrid_policy import HybridPolicyWorker

REPO = Path(__file__).resolve().parents[1]
CORRUPT_FROM_SYNC = 2


class CorruptedSyncRollout(ColocatedRollout):
    """The colocated rollout, whose engine receives noised weights after the real sync from the
    CORRUPT_FROM_SYNC-th sync on."""

    def __init__(self, group: LocalWorkerGroup):
        super().__init__(group)
        self.syncs = 0

    def sync_weights(self, policy: Policy) -> None:
        super().sync_weights(policy)
        self.syncs += 1
        if self.syncs >= CORRUPT_FROM_SYNC:
            engine = self.group.worker.rollout  # the hf engine in this process
            noise = torch.Generator().manual_seed(self.syncs)
            engine.update_weights(
                (name, tensor + 0.5 * torch.randn(tensor.shape, generator=noise))
                for name, tensor in checkpoint_tensors(engine.model).items()
            )


def overrides(workdir: Path) -> list[str]:
    data = write_arith_parquet(workdir / "data", ArithConfig(num_train=16, num_test=4, seed=3))
    return [
        f"model.path={make_tiny_model(workdir / 'model', num_layers=2)}",
        f"data.train_files=[{data['train']}]",
        "data.val_files=[]",
        "data.train_batch_size=4",
        "rollout.sampling.n=2",
        "rollout.response_length=8",
        f"trainer.output_dir={workdir / 'out'}",
        "trainer.total_training_steps=3",
        "trainer.save_freq=1",
        "trainer.n_gpus_per_node=1",
        "trainer.use_gpu=false",
        "trainer.test_freq=0",
        "trainer.val_before_train=false",
        "trainer.logger=[console,plots]",
        "trainer.mismatch_policy=stop",
        "actor.megatron.tensor_model_parallel_size=1",
        "actor.update.ppo_mini_batch_size=8",
        "actor.update.ppo_micro_batch_size=8",
        "actor.log_prob_micro_batch_size=8",
    ]


def main(workdir: Path) -> int:
    cfg, layout = prepare([str(REPO / "recipes" / "quickstart.yaml"), *overrides(workdir)])
    group = LocalWorkerGroup(ray_cls_with_init=RayClassWithInitArgs(HybridPolicyWorker, cfg))
    policy = Policy(group)
    try:
        group.init_model()
        roles = Roles(policy, rollout_group=None, critic=None, reward_model=None, groups=[group])
        trainer = PPOTrainer(cfg, roles, actor_dp=layout.actor_dp)
        trainer.rollout = CorruptedSyncRollout(group)  # the recipe's colocated rollout, corrupted
        trainer.fit(None)
        code = 0
    except RUN_STOPPING_ERRORS as err:
        code = stopped(err)
    finally:
        group.shutdown()
    print(f"policy version {policy.version}", flush=True)
    return code


if __name__ == "__main__":
    os.chdir(sys.argv[1])  # a subprocess worker: the recipe's relative paths land in its own directory
    sys.exit(main(Path(sys.argv[1]).resolve()))
