"""Colocation: several roles in one worker process per slot.

    fused = create_colocated_worker_cls({"actor_rollout": actor_cls, "critic": critic_cls})
    group = RayWorkerGroup(pool, fused)
    views = group.spawn(prefix_set=["actor_rollout", "critic"])
    views["critic"].compute_values(batch)      # runs critic_compute_values in the shared process

The fused class builds every role's worker in its `__init__` and exposes each role's
`@register`-ed methods as `<role>_<method>` with the same dispatch mode. Memory is then bounded
by the largest phase rather than the sum of the roles, and Megatron's (per-process) parallel
state is shared by the roles.
"""

from __future__ import annotations

from hybridflow.parallel_ranks import ParallelRanks
from hybridflow.single_controller.decorator import mark_registered, registered_methods
from hybridflow.single_controller.worker import RayClassWithInitArgs, Worker


def create_colocated_worker_cls(class_dict: dict[str, RayClassWithInitArgs]) -> RayClassWithInitArgs:
    """One worker class hosting every role of `class_dict` (role prefix -> class with init args).

    Role prefixes must be identifiers; the fused method names `<role>_<method>` must not collide.
    """
    if not isinstance(class_dict, dict) or not class_dict:
        raise ValueError("create_colocated_worker_cls needs a non-empty dict {role: RayClassWithInitArgs}")
    for role, cls_with_init in class_dict.items():
        if not (isinstance(role, str) and role.isidentifier()):
            raise ValueError(f"colocated role names must be identifiers, got {role!r}")
        if not isinstance(cls_with_init, RayClassWithInitArgs):
            raise TypeError(
                f"class_dict[{role!r}] must be a RayClassWithInitArgs, got {type(cls_with_init).__name__}"
            )
        if cls_with_init.actor_options:
            raise ValueError(
                f"class_dict[{role!r}] asks for Ray actor options {cls_with_init.actor_options}, which a "
                "colocated class cannot give one role alone: give the role a resource pool of its own"
            )

    class ColocatedWorker(Worker):
        """Hosts one worker per role; `<role>_<method>` delegates to that role's worker."""

        def __init__(self):
            self.role_workers = {role: spec.instantiate() for role, spec in class_dict.items()}

        def _hf_parallel_ranks(self, role: str | None = None) -> ParallelRanks | None:
            if role is None:
                raise ValueError(
                    "a colocated worker group's MEGATRON_* methods are called through spawn() views"
                )
            return self.role_workers[role].parallel_ranks

        def teardown(self) -> None:
            """Every role's teardown, each even when an earlier one fails (the first error is raised)."""
            errors = []
            for worker in self.role_workers.values():
                try:
                    worker.teardown()
                except Exception as err:
                    errors.append(err)
            if errors:
                raise errors[0]

    owner: dict[str, str] = {}
    for role, cls_with_init in class_dict.items():
        for name, spec in registered_methods(cls_with_init.cls).items():
            fused_name = f"{role}_{name}"
            if fused_name in owner:
                raise ValueError(
                    f"colocated method name {fused_name!r} is produced by both role "
                    f"{owner[fused_name]!r} and role {role!r}; rename a role or a method"
                )
            owner[fused_name] = role
            setattr(ColocatedWorker, fused_name, mark_registered(_delegate(role, name), spec))

    ColocatedWorker.__name__ = ColocatedWorker.__qualname__ = "Colocated_" + "_".join(class_dict)
    return RayClassWithInitArgs(ColocatedWorker)


def _delegate(role: str, name: str):
    # The role's own method is already @register-wrapped (future materialisation, error notes).
    def method(self, *args, **kwargs):
        return getattr(self.role_workers[role], name)(*args, **kwargs)

    method.__name__ = f"{role}_{name}"
    return method
