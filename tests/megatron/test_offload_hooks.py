"""D6: the recipe's param_offload / grad_offload / optimizer_offload reach the rollout sharding
manager's hooks, and the allocator's cache is emptied before the rollout engine resumes its
memory whatever they say. Megatron-Core's buffer moves need CUDA, so the offload functions are
stand-ins recording their calls; the order of the hooks around the weight sync is checked with the
real manager in tests/rollout/test_rollout_audit.py."""

import pytest

from engines.megatron import offload
from engines.megatron.config import MegatronConfig

CHUNKS, OPTIMIZER = ["chunk"], "optimizer"


@pytest.fixture
def calls(monkeypatch) -> list:
    recorded = []
    for name in ("offload_model", "reload_model", "offload_optimizer", "reload_optimizer"):
        monkeypatch.setattr(
            offload, name, lambda *args, _name=name, **kwargs: recorded.append((_name, args, kwargs))
        )
    monkeypatch.setattr(
        offload, "empty_device_cache", lambda: recorded.append(("empty_device_cache", (), {}))
    )
    return recorded


def run_hooks(cfg: MegatronConfig, calls: list) -> dict[str, list]:
    hooks = offload.actor_offload_hooks(cfg, CHUNKS, OPTIMIZER)
    phases = {}
    for phase in ("before_resume", "after_sync", "after_release"):
        calls.clear()
        getattr(hooks, phase)()
        phases[phase] = list(calls)
    return phases


def test_every_switch_reaches_megatron_offload(calls):
    cfg = MegatronConfig(param_offload=True, grad_offload=True, optimizer_offload=True)
    assert run_hooks(cfg, calls) == {
        "before_resume": [
            ("offload_model", (CHUNKS,), {"params": False, "grads": True}),
            ("offload_optimizer", (OPTIMIZER,), {}),
            ("empty_device_cache", (), {}),
        ],
        "after_sync": [("offload_model", (CHUNKS,), {"params": True, "grads": False})],
        "after_release": [
            ("reload_model", (CHUNKS,), {"params": True, "grads": True}),
            ("reload_optimizer", (OPTIMIZER,), {}),
        ],
    }


def test_params_alone(calls):
    phases = run_hooks(MegatronConfig(param_offload=True), calls)
    assert phases["before_resume"] == [("empty_device_cache", (), {})]
    assert phases["after_sync"] == [("offload_model", (CHUNKS,), {"params": True, "grads": False})]
    assert phases["after_release"] == [("reload_model", (CHUNKS,), {"params": True, "grads": False})]


def test_without_offload_the_cache_is_still_emptied_before_the_engine_resumes(calls):
    phases = run_hooks(MegatronConfig(), calls)
    assert phases == {
        "before_resume": [("empty_device_cache", (), {})],
        "after_sync": [],
        "after_release": [],
    }
