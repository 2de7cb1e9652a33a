"""What each worker group offers the driver, as names an editor and grep can follow.

A worker group binds its driver-side methods at run time, one per `@register`-ed method of its
worker class (hybridflow/single_controller/worker_group.py; a colocated role's view binds
`<role>_<name>` under `<name>`). Nothing in the source then says what `group.update_actor` is. The
driver's handles type their groups with the Protocols here instead: `PolicyWorker` ->
`PolicyGroup`, `CriticWorker` -> `CriticGroup`, and so on (the worker class's name with `Group`
for `Worker`). Each stub has the worker method's parameters and the driver-side return its
dispatch mode gives (hybridflow/single_controller/dispatch.py):

    ONE_TO_ALL            list: one result per rank, in rank order
    RANK_ZERO             rank 0's result
    *_PROTO               one DataProto, the ranks' outputs concatenated (a DataProtoFuture when
                          the method is registered with blocking=False)

and a docstring naming the worker method that runs. The Protocols change nothing at run time:
dispatch still goes through the bound methods. tests/test_worker_protocols.py checks every worker
class against its Protocol (the same names, parameters, returns): a new `@register`-ed method gets
its stub here.
"""

from typing import TYPE_CHECKING, Any, Protocol

import torch

from hybridflow.protocol import DataProto, DataProtoFuture

if TYPE_CHECKING:
    import ray


class PolicyGroup(Protocol):
    """The policy workers (hybridflow/workers/policy.py): the actor and the frozen reference."""

    def init_model(self) -> list[None]:
        """`PolicyWorker.init_model` (ONE_TO_ALL): builds the actor (and the reference)."""

    def compute_log_prob(self, data: DataProto) -> DataProto:
        """`PolicyWorker.compute_log_prob` (MEGATRON_COMPUTE_PROTO): `old_log_probs`, `entropys`."""

    def compute_ref_log_prob(self, data: DataProto) -> DataProto:
        """`PolicyWorker.compute_ref_log_prob` (MEGATRON_COMPUTE_PROTO): `ref_log_prob`."""

    def update_actor(self, data: DataProto) -> DataProto:
        """`PolicyWorker.update_actor` (MEGATRON_COMPUTE_PROTO): metrics in meta_info["metrics"]."""

    def train_sft(self, data: DataProto) -> DataProto:
        """`PolicyWorker.train_sft` (MEGATRON_COMPUTE_PROTO): metrics in meta_info["metrics"]."""

    def save_checkpoint(self, path: str) -> list[None]:
        """`PolicyWorker.save_checkpoint` (ONE_TO_ALL)."""

    def load_checkpoint(self, path: str) -> list[None]:
        """`PolicyWorker.load_checkpoint` (ONE_TO_ALL)."""

    def export_hf(self, out_dir: str) -> list[None]:
        """`PolicyWorker.export_hf` (ONE_TO_ALL)."""


class HybridPolicyGroup(PolicyGroup, Protocol):
    """The policy workers with rollout engines in the same processes (hybridflow/workers/hybrid_policy.py)."""

    def init_model(self) -> list[None]:
        """`HybridPolicyWorker.init_model` (ONE_TO_ALL): the policy's models, then the engines."""

    def sync_rollout_weights(self, version: int) -> list[None]:
        """`HybridPolicyWorker.sync_rollout_weights` (ONE_TO_ALL)."""

    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """`HybridPolicyWorker.generate_sequences` (MEGATRON_COMPUTE_PROTO): the responses."""

    def save_rollout_state(self, path: str) -> list[None]:
        """`HybridPolicyWorker.save_rollout_state` (ONE_TO_ALL)."""

    def load_rollout_state(self, path: str) -> list[None]:
        """`HybridPolicyWorker.load_rollout_state` (ONE_TO_ALL)."""


class TransferPolicyGroup(PolicyGroup, Protocol):
    """The policy workers that send weights to a rollout pool (hybridflow/workers/transfer_policy.py)."""

    def transfer_address(self) -> tuple[str, int]:
        """`TransferPolicyWorker.transfer_address` (RANK_ZERO): where the transfer group meets."""

    def join_transfer(self, host: str, port: int, size: int) -> list[None]:
        """`TransferPolicyWorker.join_transfer` (ONE_TO_ALL)."""

    def send_weights(self, version: int) -> list[None]:
        """`TransferPolicyWorker.send_weights` (ONE_TO_ALL)."""

    def leave_transfer(self) -> list[None]:
        """`TransferPolicyWorker.leave_transfer` (ONE_TO_ALL)."""

    def probe_log_probs(self) -> list[tuple[list[list[int]], object] | None]:
        """`TransferPolicyWorker.probe_log_probs` (ONE_TO_ALL): one rank's answer, the others None."""


class RankControls(Protocol):
    """What a `RayWorkerGroup` offers besides its worker's methods (one rank at a time;
    hybridflow/single_controller/ray_worker_group.py), as the rollout pool's handles use it."""

    @property
    def world_size(self) -> int:
        """`RayWorkerGroup.world_size`."""

    def call_rank(self, rank: int, method: str, *args, **kwargs) -> Any:
        """`RayWorkerGroup.call_rank`: `method` on one rank, blocking."""

    def call_rank_async(self, rank: int, method: str, *args, **kwargs) -> "ray.ObjectRef":
        """`RayWorkerGroup.call_rank_async`: `method` on one rank, the call in flight."""

    @staticmethod
    def wait_calls(calls: list, count: int | None = None, wait_s: float | None = None) -> list:
        """`RayWorkerGroup.wait_calls`: the finished ones of `calls`."""

    @staticmethod
    def call_result(call, rank: int, method: str) -> Any:
        """`RayWorkerGroup.call_result`: a finished call's value."""

    def kill_rank(self, rank: int) -> None:
        """`RayWorkerGroup.kill_rank`."""

    def restart_rank(self, rank: int) -> None:
        """`RayWorkerGroup.restart_rank`."""

    def dead_ranks(self, wait_s: float = ...) -> list[int]:
        """`RayWorkerGroup.dead_ranks`."""


class RolloutGroup(RankControls, Protocol):
    """The rollout pool's workers (hybridflow/workers/rollout_worker.py), always a `RayWorkerGroup`."""

    def init_model(self) -> list[None]:
        """`RolloutWorker.init_model` (ONE_TO_ALL): builds the engine."""

    def start_join_transfer(self, host: str, port: int, size: int) -> list[None]:
        """`RolloutWorker.start_join_transfer` (ONE_TO_ALL): joins in the background."""

    def start_receive_weights(self) -> list[None]:
        """`RolloutWorker.start_receive_weights` (ONE_TO_ALL): receives in the background."""

    def finish_transfer(self) -> list[int]:
        """`RolloutWorker.finish_transfer` (ONE_TO_ALL): the version each engine serves."""

    def leave_transfer(self) -> list[None]:
        """`RolloutWorker.leave_transfer` (ONE_TO_ALL)."""

    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """`RolloutWorker.generate_sequences` (DP_COMPUTE_PROTO): the responses."""

    def generate_sequences_async(self, prompts: DataProto) -> DataProtoFuture:
        """`RolloutWorker.generate_sequences_async` (DP_COMPUTE_PROTO, non-blocking)."""

    def generate_request(self, prompt_ids: list[int], sampling, seed: int, max_new_tokens: int) -> list:
        """`RolloutWorker.generate_request` (ONE_TO_ALL; the router calls one rank with
        `call_rank_async`): one agent turn's `Completion`."""

    def ping(self) -> list[None]:
        """`RolloutWorker.ping` (ONE_TO_ALL)."""

    def health_check(self) -> list[None]:
        """`RolloutWorker.health_check` (ONE_TO_ALL)."""

    def score_log_probs(self, sequences: list[list[int]]) -> list[torch.Tensor | None]:
        """`RolloutWorker.score_log_probs` (ONE_TO_ALL)."""

    def advance_rng_state(self, position: dict) -> list[None]:
        """`RolloutWorker.advance_rng_state` (ONE_TO_ALL)."""

    def save_rng_state(self, path: str) -> list[None]:
        """`RolloutWorker.save_rng_state` (ONE_TO_ALL)."""

    def load_rng_state(self, path: str) -> list[dict]:
        """`RolloutWorker.load_rng_state` (ONE_TO_ALL): each engine's sampling position."""


class CriticGroup(Protocol):
    """The value model's workers (hybridflow/workers/critic.py)."""

    def init_model(self) -> list[None]:
        """`CriticWorker.init_model` (ONE_TO_ALL)."""

    def compute_values(self, data: DataProto) -> DataProto:
        """`CriticWorker.compute_values` (MEGATRON_COMPUTE_PROTO): `values`."""

    def update_critic(self, data: DataProto) -> DataProto:
        """`CriticWorker.update_critic` (MEGATRON_COMPUTE_PROTO): metrics in meta_info["metrics"]."""

    def update_critic_async(self, data: DataProto) -> DataProtoFuture:
        """`CriticWorker.update_critic_async` (MEGATRON_COMPUTE_PROTO, non-blocking)."""

    def save_checkpoint(self, path: str) -> list[None]:
        """`CriticWorker.save_checkpoint` (ONE_TO_ALL)."""

    def load_checkpoint(self, path: str) -> list[None]:
        """`CriticWorker.load_checkpoint` (ONE_TO_ALL)."""


class RewardModelGroup(Protocol):
    """The learned reward model's workers (hybridflow/workers/reward_model.py)."""

    def init_model(self) -> list[None]:
        """`RewardModelWorker.init_model` (ONE_TO_ALL)."""

    def compute_rm_score(self, data: DataProto) -> DataProto:
        """`RewardModelWorker.compute_rm_score` (MEGATRON_COMPUTE_PROTO): `rm_scores`."""


class TeacherGroup(Protocol):
    """On-policy distillation's teacher workers (hybridflow/workers/teacher.py)."""

    def init_model(self) -> list[None]:
        """`TeacherWorker.init_model` (ONE_TO_ALL)."""

    def compute_teacher_log_prob(self, data: DataProto) -> DataProto:
        """`TeacherWorker.compute_teacher_log_prob` (MEGATRON_COMPUTE_PROTO): `teacher_log_prob`."""
