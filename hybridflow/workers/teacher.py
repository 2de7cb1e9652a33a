"""The on-policy distillation teacher: a frozen Megatron model of another checkpoint (the reference
policy is a frozen copy of the student; the teacher is any model sharing the student's tokenizer)
that scores the student's sampled responses token by token.

It is a role of its own so that its layout can be its own: in the actor's processes (colocated,
like the reward model; then Megatron's parallel state, which is per process, makes its TP / PP
the actor's), or on a pool of its own (teacher.n_gpus_per_node > 0) at any TP / PP. The log-probs
go through the actor's forward path (packed or padded micro-batches), so teacher and student
numbers are computed the same way.

Engines are imported inside `init_model`, so importing this module stays free of Megatron.
"""

from hybridflow.config.schema import RecipeConfig
from hybridflow.protocol import DataProto
from hybridflow.single_controller import Dispatch, Worker, register
from hybridflow.workers.megatron_setup import init_parallel_state


class TeacherWorker(Worker):
    def __init__(self, config: RecipeConfig):
        self.config = config

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        from engines.megatron.actor import MegatronActor
        from engines.megatron.build import build_model

        teacher = self.config.teacher
        init_parallel_state(self, teacher.megatron, self.config.rollout)
        chunks = build_model(teacher.path, teacher.megatron, for_training=False)
        self.scorer = MegatronActor(chunks, update_cfg=self.config.actor.update)  # frozen: no optimizer

    @register(dispatch_mode=Dispatch.MEGATRON_COMPUTE_PROTO)
    def compute_teacher_log_prob(self, data: DataProto) -> DataProto | None:
        """`teacher_log_prob` (B, R): the teacher's log-probs of the sampled response tokens, at the
        rollout temperature like the student's `old_log_probs` (on the last pipeline stage, the one
        collected; the other stages return None)."""
        teacher = self.config.teacher
        packed = self.config.actor.update.use_dynamic_bsz
        data.meta_info.update(
            temperature=self.config.rollout.sampling.temperature,
            micro_batch_size=teacher.log_prob_micro_batch_size,
            max_token_len=teacher.log_prob_max_token_len_per_gpu if packed else None,
        )
        out = self.scorer.compute_log_prob(data, calculate_entropy=False)
        return None if out is None else out.rename("old_log_probs", "teacher_log_prob")
