"""Places the recipe's roles on Ray worker groups and hands the driver its handles.

One pool ("global_pool") holds one process per device with the policy (actor, reference and, in
the colocated placement, the rollout engines: `HybridPolicyWorker`), and the critic and reward
model too unless the critic asks for its own pool. The driver gets a `Policy` handle, with
trainer.placement=disaggregated the rollout pool's group ("rollout_pool", fed by a
`TransferPolicyWorker`; the trainer builds its rollout handle with `rollout.make.make_rollout`),
and a handle per other role (hybridflow/trainer/handles.py; the distillation teacher's in the
global pool, or its own "teacher_pool" when teacher.n_gpus_per_node > 0). Models are built critic
first and policy last, so the rollout engine sees what memory the others left.
"""

from dataclasses import dataclass, field

from hybridflow.checks.roles import teacher_devices_per_node, uses_teacher
from hybridflow.config.schema import RecipeConfig
from hybridflow.single_controller import RayClassWithInitArgs, WorkerGroup, create_colocated_worker_cls
from hybridflow.trainer.handles import Critic, RewardModel, Teacher
from hybridflow.trainer.policy import Policy
from hybridflow.trainer.rollout.pool import connect_transfer
from hybridflow.workers.critic import CriticWorker
from hybridflow.workers.hybrid_policy import HybridPolicyWorker
from hybridflow.workers.protocols import RolloutGroup
from hybridflow.workers.reward_model import RewardModelWorker
from hybridflow.workers.rollout_worker import RolloutWorker
from hybridflow.workers.rollout_worker import actor_options as rollout_actor_options
from hybridflow.workers.teacher import TeacherWorker
from hybridflow.workers.transfer_policy import TransferPolicyWorker


@dataclass
class Roles:
    """The driver's handles (None when the recipe does not use the role) over Ray worker groups,
    or a LocalWorkerGroup for a one-process run without Ray (scripts/gpu_check.py)."""

    policy: Policy
    rollout_group: RolloutGroup | None  # the rollout pool's workers; None: the engines are the policy's
    critic: Critic | None
    reward_model: RewardModel | None
    groups: list[WorkerGroup]  # the underlying groups, for shutdown
    teacher: Teacher | None = None  # on-policy distillation's teacher (workers/teacher.py)
    resource_pools: list = field(default_factory=list)  # their slots (Ray placement groups)

    def shutdown(self) -> None:
        """Stops every group's processes, then frees their slots, so that a restart of the run
        (trainer.restart_on_failure) can place new ones."""
        stop_and_release(self.groups, self.resource_pools)


def stop_and_release(groups: list[WorkerGroup], pools: list) -> None:
    """Stops the groups' processes, then removes their pools' placement groups."""
    for group in groups:
        group.shutdown()
    for pool in pools:
        pool.release()


def uses_reference(cfg: RecipeConfig) -> bool:
    """The reference policy is needed only when KL is in the reward or in the loss."""
    return cfg.trainer.mode == "rl" and (cfg.algorithm.use_kl_in_reward or cfg.actor.update.use_kl_loss)


def role_classes(cfg: RecipeConfig) -> dict[str, dict[str, RayClassWithInitArgs]]:
    """Pool name -> {role prefix: worker class with its init args}."""
    disaggregated = cfg.trainer.placement == "disaggregated" and cfg.trainer.mode == "rl"
    policy_cls = TransferPolicyWorker if disaggregated else HybridPolicyWorker
    policy = RayClassWithInitArgs(policy_cls, cfg, with_reference=uses_reference(cfg))
    pools = {"global_pool": {"policy": policy}}
    if cfg.trainer.mode == "sft":  # supervised warm start: the policy alone
        return pools
    if disaggregated:
        rollout = RayClassWithInitArgs(RolloutWorker, cfg).with_actor_options(**rollout_actor_options(cfg))
        pools["rollout_pool"] = {"rollout": rollout}
    if cfg.critic.enable:
        pool = "critic_pool" if cfg.critic.n_gpus_per_node > 0 else "global_pool"
        pools.setdefault(pool, {})["critic"] = RayClassWithInitArgs(CriticWorker, cfg)
    if cfg.reward_model.enable:
        pools["global_pool"]["reward_model"] = RayClassWithInitArgs(RewardModelWorker, cfg)
    if uses_teacher(cfg):
        pool = "teacher_pool" if teacher_devices_per_node(cfg) else "global_pool"
        pools.setdefault(pool, {})["teacher"] = RayClassWithInitArgs(TeacherWorker, cfg)
    return pools


def resource_pool_manager(cfg: RecipeConfig):
    """The `ResourcePoolManager` of the recipe's pools (imported here: it needs Ray)."""
    from hybridflow.single_controller import ResourcePoolManager, Role

    trainer, critic = cfg.trainer, cfg.critic
    own_critic = critic.enable and critic.n_gpus_per_node > 0
    own_teacher = teacher_devices_per_node(cfg)
    spec = {
        "global_pool": [trainer.n_gpus_per_node - (critic.n_gpus_per_node if own_critic else 0) - own_teacher]
        * trainer.nnodes
    }
    mapping = {
        Role.ActorRolloutRef: "global_pool",
        Role.RewardModel: "global_pool",
        Role.Critic: "global_pool",
    }
    if own_critic:
        spec["critic_pool"] = [critic.n_gpus_per_node] * trainer.nnodes
        mapping[Role.Critic] = "critic_pool"
    if own_teacher:
        spec["teacher_pool"] = [own_teacher] * trainer.nnodes
    if trainer.placement == "disaggregated" and trainer.mode == "rl":
        spec["rollout_pool"] = [trainer.rollout_pool.n_gpus_per_node] * trainer.rollout_pool.nnodes
    return ResourcePoolManager(resource_pool_spec=spec, mapping=mapping, use_gpu=trainer.use_gpu)


def start_roles(cfg: RecipeConfig) -> Roles:
    """Starts every worker process and builds every model (a Ray cluster must be connected). A
    failure on the way stops what started and frees its slots before it is raised: the cluster
    outlives a driver that called `main` in process, and its next run needs those slots."""
    manager = resource_pool_manager(cfg)
    manager.create_resource_pool()
    pools, groups = list(manager.resource_pool_dict.values()), []
    try:
        views = spawn_groups(cfg, manager, groups)
        return handles(views, groups, pools)
    except BaseException:
        stop_and_release(groups, pools)
        raise


def spawn_groups(cfg: RecipeConfig, manager, groups: list[WorkerGroup]) -> dict[str, WorkerGroup]:
    """One worker group per pool (appended to `groups` as each starts); role -> its view."""
    from hybridflow.single_controller import RayWorkerGroup
    from hybridflow.single_controller.errors import CallDeadline

    deadline = CallDeadline(cfg.trainer.worker_call_timeout_s, "trainer.worker_call_timeout_s")
    views = {}
    for pool_name, classes in role_classes(cfg).items():
        pool = manager.resource_pool_dict[pool_name]
        if len(classes) == 1:
            ((role, cls_with_init),) = classes.items()
            group = RayWorkerGroup(pool, cls_with_init, deadline)
            views[role] = group
        else:
            group = RayWorkerGroup(pool, create_colocated_worker_cls(classes), deadline)
            views.update(group.spawn(prefix_set=list(classes)))
        groups.append(group)
    return views


def handles(views: dict, groups: list[WorkerGroup], pools: list) -> Roles:
    """Builds every role's models and the driver's handles over them."""
    # The rollout pool last: its vLLM engines pick free ports of their own, which must not be the
    # ones the other groups were given for their process groups but have not bound yet.
    for role in ("critic", "reward_model", "teacher", "policy", "rollout"):
        if role in views:
            views[role].init_model()
    policy, rollout = views["policy"], views.get("rollout")
    if rollout is not None:
        connect_transfer(policy, rollout)
    critic = Critic(views["critic"]) if "critic" in views else None
    reward_model = RewardModel(views["reward_model"]) if "reward_model" in views else None
    teacher = Teacher(views["teacher"]) if "teacher" in views else None
    return Roles(Policy(policy), rollout, critic, reward_model, groups, teacher, resource_pools=pools)
