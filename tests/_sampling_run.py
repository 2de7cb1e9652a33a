"""One step of recipes/quickstart.yaml on the tiny model, on the one-process path (LocalWorkerGroup,
the Megatron actor, the colocated rollout engine, PPOTrainer.fit), for the tests that compare the
engine's log-probs with the actor's under a sampling setting (tests/test_sampling_mismatch.py).
The engine's top-4 tokens come back too (rollout.top_k_log_probs), so the step's metrics hold both
mismatch checks, and the KL loss to the reference (the initial policy); they land in
WORKDIR/out/metrics.jsonl.

    python tests/_sampling_run.py WORKDIR ENGINE [OVERRIDE ...]
"""

import os
import sys
from pathlib import Path

from hybridflow.data.arith import ArithConfig, write_arith_parquet
from hybridflow.single_controller import LocalWorkerGroup, RayClassWithInitArgs
from hybridflow.trainer.main import prepare
from hybridflow.trainer.policy import Policy
from hybridflow.trainer.ppo_trainer import PPOTrainer
from hybridflow.trainer.roles import Roles
from hybridflow.utils.tiny_model import make_tiny_model
from hybridflow.workers.hybrid_policy import HybridPolicyWorker

REPO = Path(__file__).resolve().parents[1]


def overrides(workdir: Path, engine: str) -> list[str]:
    data = write_arith_parquet(workdir / "data", ArithConfig(num_train=8, num_test=4, seed=3))
    return [
        f"model.path={make_tiny_model(workdir / 'model', num_layers=2)}",
        f"data.train_files=[{data['train']}]",
        "data.val_files=[]",
        "data.train_batch_size=4",
        f"rollout.name={engine}",
        "rollout.sampling.n=2",
        "rollout.response_length=8",
        "rollout.top_k_log_probs=4",
        f"trainer.output_dir={workdir / 'out'}",
        "trainer.total_training_steps=1",
        "trainer.save_freq=0",
        "trainer.n_gpus_per_node=1",
        "trainer.use_gpu=false",
        "trainer.test_freq=0",
        "trainer.val_before_train=false",
        "trainer.logger=[console]",
        "actor.megatron.tensor_model_parallel_size=1",
        "actor.update.use_kl_loss=true",  # a reference, filtered as the policy is
        "actor.update.ppo_mini_batch_size=8",
        "actor.update.ppo_micro_batch_size=8",
        "actor.log_prob_micro_batch_size=8",
    ]


def main(workdir: Path, engine: str, extra: list[str]) -> None:
    cfg, layout = prepare([str(REPO / "recipes" / "quickstart.yaml"), *overrides(workdir, engine), *extra])
    group = LocalWorkerGroup(ray_cls_with_init=RayClassWithInitArgs(HybridPolicyWorker, cfg))
    try:
        group.init_model()
        roles = Roles(Policy(group), rollout_group=None, critic=None, reward_model=None, groups=[group])
        PPOTrainer(cfg, roles, actor_dp=layout.actor_dp).fit(None)
    finally:
        group.shutdown()


if __name__ == "__main__":
    os.chdir(sys.argv[1])  # a subprocess worker: the recipe's relative paths land in its own directory
    main(Path(sys.argv[1]).resolve(), sys.argv[2], sys.argv[3:])
