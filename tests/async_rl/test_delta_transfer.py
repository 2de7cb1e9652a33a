"""Delta weight transfers over a real transfer group (gloo, this process: the sender and two
receivers in threads), into hf engines of the tiny model in bf16:

- after every sync each engine holds exactly what an engine given the full tensors holds (its
  read-back checksums equal a reference engine's, loaded the full way);
- the first sync, and the first after a receiver restarted (a fresh receiver with no copy), send
  every tensor whole; the syncs between send a small share of the bytes.
"""

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from engines.rollout.config import RolloutConfig
from engines.rollout.hf_rollout import HFRolloutEngine, checkpoint_tensors
from engines.weight_sync.transfer import WeightReceiver, WeightSender, sender_store, transfer_group
from hybridflow.utils.tiny_model import make_tiny_model

HOST, TIMEOUT_S = "127.0.0.1", 120.0
LR = 1e-5


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(make_tiny_model(tmp_path_factory.mktemp("delta_transfer") / "tiny", num_layers=2))


def engine(model_dir: str) -> HFRolloutEngine:
    return HFRolloutEngine(model_dir, RolloutConfig(name="hf", dtype="bfloat16", load_format="auto"))


def versions(model_dir: str, count: int) -> list[list[tuple[str, torch.Tensor]]]:
    """fp32 master weights after 0..count-1 Adam-sized steps of LR per element (signs of noise)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    master = {name: t.detach().clone() for name, t in checkpoint_tensors(model).items()}
    gen, out = torch.Generator().manual_seed(0), []
    for _ in range(count):
        out.append([(name, t.clone()) for name, t in master.items()])
        for t in master.values():
            t -= LR * torch.randn(t.shape, generator=gen).sign()
    return out


class Group:
    """A sender and receivers meeting at a fresh store (a new group, as after a restart)."""

    def __init__(self, receivers: list[WeightReceiver | None], sender: WeightSender | None = None):
        store = sender_store(HOST, timeout_s=TIMEOUT_S)
        size = 1 + len(receivers)
        with ThreadPoolExecutor(len(receivers)) as pool:
            joins = [
                pool.submit(transfer_group, HOST, store.port, 1 + i, size, "gloo", TIMEOUT_S)
                for i in range(len(receivers))
            ]
            group = transfer_group(HOST, store.port, 0, size, "gloo", TIMEOUT_S, store=store)
            groups = [join.result() for join in joins]
        if sender is None:
            sender = WeightSender(group, bucket_mb=0.05, delta_dtype=torch.bfloat16)
        sender.group = group
        for i, receiver in enumerate(receivers):
            if receiver is None:
                receivers[i] = WeightReceiver(groups[i], delta_dtype=torch.bfloat16)
            else:
                receivers[i].group = groups[i]
        self.sender, self.receivers = sender, receivers

    def sync(self, engines: list[HFRolloutEngine], tensors, version: int) -> dict[str, float]:
        with ThreadPoolExecutor(len(engines)) as pool:
            loads = [pool.submit(r.load_into, e) for r, e in zip(self.receivers, engines, strict=True)]
            self.sender.send(iter(tensors), version)
            assert [load.result() for load in loads] == [version] * len(engines)
        return self.sender.stats.metrics()

    def close(self) -> None:
        for member in (self.sender, *self.receivers):
            member.group.close()


def test_delta_syncs_hold_a_full_syncs_bits_and_a_restart_gets_a_full_sync(model_dir):
    weights = versions(model_dir, 5)
    engines, reference = [engine(model_dir), engine(model_dir)], engine(model_dir)
    group, shares, sent = Group([None, None]), [], []
    try:
        for version in range(5):
            if version == 3:  # receiver 1 restarted: a fresh process, a new group
                group.close()
                engines[1] = engine(model_dir)
                group = Group([group.receivers[0], None], sender=group.sender)
            metrics = group.sync(engines, weights[version], version)
            reference.update_weights(weights[version])  # a full sync's load: the fp32 tensors
            expected = reference.weight_checksums()
            assert [e.weight_checksums() for e in engines] == [expected, expected], version
            shares.append(metrics["weight_sync/changed_share"])
            sent.append(metrics["weight_sync/bytes_sent"] / metrics["weight_sync/bytes_full"])
    finally:
        group.close()
    assert shares[0] == 1.0 and shares[3] == 1.0 and sent[0] == 1.0 and sent[3] == 1.0
    assert all(0 < shares[v] < 0.5 and sent[v] < 0.5 for v in (1, 2, 4)), (shares, sent)


@pytest.mark.usefixtures("in_quickstart_working_tree")
def test_delta_transfers_with_a_colocated_rollout_are_refused_by_name():
    from hybridflow.checks.recipe import RecipeError, validate_recipe
    from hybridflow.config.loader import load_recipe

    recipe = Path(__file__).resolve().parents[2] / "recipes/quickstart.yaml"
    with pytest.raises(RecipeError) as refused:
        validate_recipe(load_recipe(recipe, ["rollout.weight_sync_delta=true"]), cuda_available=False)
    assert any(
        "rollout.weight_sync_delta=true applies to trainer.placement=disaggregated" in e
        for e in refused.value.errors
    )


STEPS = 10


@pytest.mark.slow
def test_a_ten_step_run_with_delta_syncs_loads_each_version_bit_identical(gsm8k_local, tmp_path):
    """GRPO in process, disaggregated, hf engine in bf16, lr 1e-5: the first sync sends every tensor
    whole, each later one a share of the bytes; every tensor of every sync is checked by the receiver
    against the sender's checksum of the full tensor (a mismatch fails the transfer, and the run)."""
    from gsm8k_tiny import ACTOR_AND_POOL_OF_ONE, cpu_overrides
    from recipe_runs import run_recipe_in_process

    out = tmp_path / "run"
    overrides = [
        *cpu_overrides(gsm8k_local, out, tp=1),
        *ACTOR_AND_POOL_OF_ONE,
        f"trainer.total_training_steps={STEPS}",
        f"trainer.test_freq={STEPS}",  # after the last step's metrics: no step counts its transfer
        "trainer.save_freq=0",
        "rollout.dtype=bfloat16",
        "rollout.weight_sync_delta=true",
        "rollout.sampling.n=2",
        "actor.optim.lr=1e-5",
        "actor.update.ppo_mini_batch_size=4",
    ]
    result = run_recipe_in_process("recipes/gsm8k_grpo.yaml", overrides, pythonpath=gsm8k_local["root"])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "reward/mean" in r]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    assert all(r["async/weight_syncs"] == 1.0 and "timing/weight_sync" in r for r in steps)
    full = steps[0]["weight_sync/bytes_full"]
    assert steps[0]["weight_sync/bytes_sent"] == full and steps[0]["weight_sync/changed_share"] == 1.0
    for r in steps[1:]:
        assert r["weight_sync/bytes_full"] == full
        assert r["weight_sync/bytes_sent"] < full and r["weight_sync/changed_share"] < 1.0, r
