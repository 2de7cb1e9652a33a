"""Fixtures shared by the whole suite: one Ray cluster per session, tiny models built locally."""

import os

import pytest

# Ray and torch each start thread pools sized to the machine; on 2 cores that oversubscribes.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
# Tests never download: Hub ids resolve only from caches the tests fill (tests/hub_cache.py).
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray instance for the session. Logical CPUs exceed the 2 real cores so that
    8-rank worker groups can be placed; tests that need their own cluster (multi-node
    simulation) run in a subprocess instead of shutting this one down."""
    import ray

    if not ray.is_initialized():
        ray.init(num_cpus=16, include_dashboard=False, log_to_driver=True, configure_logging=False)
    yield ray
    ray.shutdown()
