"""The driver-side Protocols (hybridflow/workers/protocols.py) say what the worker groups really
offer: for every worker class, its Protocol has a stub for each `@register`-ed method and no other,
with the worker method's parameters, the return the method's dispatch mode gives the driver
(dispatch.py's collect functions) and a docstring naming the worker method; `RankControls` has
`RayWorkerGroup`'s own methods. The classes are read as the worker group reads them
(`registered_methods`); no worker runs."""

import importlib
import inspect
import pkgutil
import typing

import pytest

import hybridflow.workers
from hybridflow.protocol import DataProto, DataProtoFuture
from hybridflow.single_controller import Dispatch, Execute, Worker, register
from hybridflow.single_controller.decorator import MethodSpec, registered_methods
from hybridflow.workers import protocols
from hybridflow.workers.policy import PolicyWorker

# The modes whose collect gives the driver a list of the ranks' results (dispatch.py).
LIST_MODES = {
    Dispatch.ONE_TO_ALL,
    Dispatch.ALL_TO_ALL,
    Dispatch.DP_COMPUTE,
    Dispatch.DP_COMPUTE_METRIC,
    Dispatch.MEGATRON_COMPUTE,
}


def worker_classes() -> list[type]:
    """Every Worker subclass defined in a module of hybridflow/workers/."""
    classes = []
    for info in pkgutil.iter_modules(hybridflow.workers.__path__):
        module = importlib.import_module(f"hybridflow.workers.{info.name}")
        classes += [
            value
            for value in vars(module).values()
            if isinstance(value, type) and issubclass(value, Worker) and value.__module__ == module.__name__
        ]
    return sorted(classes, key=lambda cls: cls.__name__)


def protocol_of(worker_cls: type) -> type:
    name = worker_cls.__name__.removesuffix("Worker") + "Group"
    assert hasattr(protocols, name), f"{worker_cls.__name__} has no Protocol {name} in protocols.py"
    return getattr(protocols, name)


def stub_names(protocol: type) -> set[str]:
    """The Protocol's stubs of worker methods (its own and inherited; not RankControls')."""
    own = [klass for klass in protocol.__mro__ if klass.__module__ == protocols.__name__]
    return {
        name
        for klass in own
        if klass is not protocols.RankControls
        for name in vars(klass)
        if not name.startswith("_")
    }


# Ray's tracing helper (ray/util/tracing/tracing_helper.py) adds this keyword to the signature of
# every method of a class passed to ray.remote, in place: a worker group made earlier in the same
# pytest process has done so to the worker classes. No caller passes it.
RAY_TRACE_PARAMETER = "_ray_trace_ctx"


def parameters(function) -> str:
    """Its signature less `self`, Ray's tracing keyword, the annotations and the default values
    (`=Ellipsis`: a default)."""
    skipped = ("self", RAY_TRACE_PARAMETER)
    found = [p for p in inspect.signature(function).parameters.values() if p.name not in skipped]
    bare = [p.replace(annotation=p.empty, default=p.empty if p.default is p.empty else ...) for p in found]
    return str(inspect.Signature(bare))


def driver_return(spec: MethodSpec, worker_return):
    """What the driver gets from a group call, given what each rank returns (None: not annotated)."""
    if spec.execute_mode is Execute.RANK_ZERO:
        return worker_return
    assert spec.dispatch_mode is not None, "a custom dispatch pair: give its driver-side return a rule here"
    if "_proto" in spec.dispatch_mode.value:
        return DataProto if spec.blocking else DataProtoFuture
    assert spec.dispatch_mode in LIST_MODES and spec.blocking, f"no rule for {spec}"
    return list if worker_return is None else list[None if worker_return is type(None) else worker_return]


def stub_problems(worker_cls: type, protocol: type, name: str, spec: MethodSpec) -> list[str]:
    worker_method, stub = getattr(worker_cls, name), getattr(protocol, name)
    where = f"{protocol.__name__}.{name}"
    problems = []
    if parameters(stub) != parameters(worker_method):
        problems.append(f"{where} takes {parameters(stub)}, the worker {parameters(worker_method)}")
    expected = driver_return(spec, typing.get_type_hints(worker_method).get("return"))
    returns = typing.get_type_hints(stub).get("return")
    if returns != expected and not (expected is list and typing.get_origin(returns) is list):
        problems.append(f"{where} returns {returns}, a group call gives {expected}")
    owner = next(klass for klass in worker_cls.__mro__ if name in vars(klass)).__name__
    if f"`{owner}.{name}`" not in (stub.__doc__ or ""):
        problems.append(f"{where}'s docstring does not name `{owner}.{name}`")
    return problems


def drift(worker_cls: type, protocol: type) -> list[str]:
    """Every way `protocol` differs from the driver-side methods of `worker_cls`."""
    registered = registered_methods(worker_cls)
    stubs = stub_names(protocol)
    missing = [name for name in registered if name not in stubs]
    problems = [f"{worker_cls.__name__}.{name} has no stub in {protocol.__name__}" for name in missing]
    extra = sorted(stubs - set(registered))
    problems += [f"{protocol.__name__}.{name} is no registered method" for name in extra]
    for name in sorted(set(registered) & stubs):
        problems += stub_problems(worker_cls, protocol, name, registered[name])
    return problems


def test_the_workers_are_found():
    names = {cls.__name__ for cls in worker_classes()}
    assert {"PolicyWorker", "HybridPolicyWorker", "RolloutWorker", "TeacherWorker"} <= names


@pytest.mark.parametrize("worker_cls", worker_classes(), ids=lambda cls: cls.__name__)
def test_each_worker_class_matches_its_protocol(worker_cls):
    assert drift(worker_cls, protocol_of(worker_cls)) == []


@pytest.mark.parametrize("worker_cls", worker_classes(), ids=lambda cls: cls.__name__)
def test_a_worker_class_made_a_ray_actor_class_still_matches(worker_cls):
    """As after a worker group of it ran in this process: ray.remote traces its methods in place."""
    import ray

    class Traced(worker_cls):
        pass

    Traced.__name__ = worker_cls.__name__
    ray.remote(Traced)
    assert RAY_TRACE_PARAMETER in str(inspect.signature(Traced.__dict__.get("__init__", Traced.__init__)))
    assert drift(Traced, protocol_of(worker_cls)) == []


class DriftedPolicyWorker(PolicyWorker):
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def reload_weights(self, path: str) -> None:
        """A registered method the Protocol does not have."""

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def export_hf(self, out_dir: str, safe: bool = True) -> dict:
        """A parameter and a return the Protocol's stub does not have."""

    compute_log_prob = PolicyWorker.compute_log_prob.__wrapped__  # registered no more


def test_drift_is_found():
    assert drift(DriftedPolicyWorker, protocols.PolicyGroup) == [
        "DriftedPolicyWorker.reload_weights has no stub in PolicyGroup",
        "PolicyGroup.compute_log_prob is no registered method",
        "PolicyGroup.export_hf takes (out_dir), the worker (out_dir, safe=Ellipsis)",
        "PolicyGroup.export_hf returns list[None], a group call gives list[dict]",
        "PolicyGroup.export_hf's docstring does not name `DriftedPolicyWorker.export_hf`",
    ]


def test_rank_controls_are_ray_worker_groups_methods():
    from hybridflow.single_controller.ray_worker_group import RayWorkerGroup

    controls = [name for name in vars(protocols.RankControls) if not name.startswith("_")]
    assert "call_rank_async" in controls
    for name in controls:
        ours, theirs = (getattr(cls, name) for cls in (protocols.RankControls, RayWorkerGroup))
        static = (inspect.getattr_static(cls, name) for cls in (protocols.RankControls, RayWorkerGroup))
        assert type(next(static)) is type(next(static)), name  # a property, staticmethod or function alike
        if not isinstance(ours, property):
            assert parameters(ours) == parameters(theirs), name
