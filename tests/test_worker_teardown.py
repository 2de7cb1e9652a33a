"""D7: a worker's teardown stops its rollout engine (SGLang's scheduler processes would otherwise
outlive the run: SGLang handles SIGTERM only inside its event loop), and every engine offers
`shutdown` as the RolloutEngine protocol says. The worker-group side (teardown on every rank
before the processes end) is in test_single_controller_local.py and
test_single_controller_colocate_and_failures.py."""

import pytest

from engines.rollout.base import RolloutEngine
from engines.rollout.hf_rollout import HFRolloutEngine
from engines.rollout.sglang_rollout import SGLangRolloutEngine
from engines.rollout.vllm_rollout import VLLMRolloutEngine
from hybridflow.single_controller import LocalWorkerGroup, RayClassWithInitArgs
from hybridflow.workers.hybrid_policy import HybridPolicyWorker
from hybridflow.workers.policy import PolicyWorker


class StandInEngine:
    def __init__(self):
        self.shutdowns = 0

    def shutdown(self) -> None:
        self.shutdowns += 1


@pytest.fixture
def spmd_env_restored(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)


def test_the_policy_worker_group_shutdown_stops_the_rollout_engine(spmd_env_restored):
    group = LocalWorkerGroup(ray_cls_with_init=RayClassWithInitArgs(HybridPolicyWorker, None))
    engine = group.worker.rollout = StandInEngine()
    group.shutdown()
    assert engine.shutdowns == 1


def test_a_worker_without_an_engine_tears_down_quietly():
    PolicyWorker(None, with_reference=True).teardown()  # a policy worker without an engine
    worker = HybridPolicyWorker(None)
    worker.rollout = None  # a rank of an SGLang rollout group that is not the group's first
    worker.teardown()


def test_every_engine_implements_the_rollout_engine_protocol():
    methods = [name for name in vars(RolloutEngine) if not name.startswith("_")]
    assert "shutdown" in methods
    for engine_cls in (HFRolloutEngine, SGLangRolloutEngine, VLLMRolloutEngine):
        missing = [name for name in methods if not callable(getattr(engine_cls, name, None))]
        assert missing == [], f"{engine_cls.__name__} lacks {missing}"
