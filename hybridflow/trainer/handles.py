"""The driver's handles of the roles besides the policy and the rollout: each the worker group of
one role as the training loop uses it, calling the group's methods by name (typed by the
Protocols of hybridflow/workers/protocols.py), as `Policy` (policy.py) does.

    reference.log_probs(batch)       the frozen reference's `ref_log_prob` (KL in the reward or loss)
    teacher.log_probs(batch)         the distillation teacher's `teacher_log_prob`
    critic.values(batch)             the value model's `values`
    critic.start_update(batch)       PPO epochs of the value model, in flight while the policy updates
    critic.save(path) / load(path)   the value model's checkpoint part
    reward_model.scores(batch)       the learned reward model's `rm_scores` (B, R)
"""

from hybridflow.protocol import DataProto, DataProtoFuture
from hybridflow.workers.protocols import CriticGroup, PolicyGroup, RewardModelGroup, TeacherGroup


class Reference:
    def __init__(self, group: PolicyGroup):
        self.group = group  # the policy workers, which hold the reference beside the actor

    def log_probs(self, batch: DataProto) -> DataProto:
        return self.group.compute_ref_log_prob(batch)


class Teacher:
    def __init__(self, group: TeacherGroup):
        self.group = group  # on-policy distillation's teacher workers (hybridflow/workers/teacher.py)

    def log_probs(self, batch: DataProto) -> DataProto:
        """The teacher's log-probs of the student's response tokens."""
        return self.group.compute_teacher_log_prob(batch)


class Critic:
    def __init__(self, group: CriticGroup):
        self.group = group  # the value model's workers (hybridflow/workers/critic.py)

    def values(self, batch: DataProto) -> DataProto:
        return self.group.compute_values(batch)

    def start_update(self, batch: DataProto) -> DataProtoFuture:
        """PPO epochs over the batch, in flight (on a pool of its own the critic updates while the
        policy does); `.get()` gives the metrics in meta_info["metrics"]."""
        return self.group.update_critic_async(batch)

    def save(self, path: str) -> None:
        self.group.save_checkpoint(path)

    def load(self, path: str) -> None:
        self.group.load_checkpoint(path)


class RewardModel:
    def __init__(self, group: RewardModelGroup):
        self.group = group  # the learned reward model's workers (hybridflow/workers/reward_model.py)

    def scores(self, batch: DataProto) -> DataProto:
        """`rm_scores` (B, R): each response's score on its last real token."""
        return self.group.compute_rm_score(batch)
