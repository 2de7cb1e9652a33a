"""Seeds of a generation call split over the rollout pool's processes: each row is seeded by its
index in the whole call, not in the chunk its process got, so the n samples of one prompt spread
over several processes are n different samples (a GRPO group of copies has no advantage to learn
from), and a seed gives the same samples whatever the number of processes.

The unit tests take the chunks the pool's dispatch makes (DataProto.chunk, padded as dispatch
pads) through the engines' own seeding (`SeededGenerationMixin.start_call`, then `row_seed` per
row as the vLLM and SGLang engines seed requests). The slow test runs the pool itself: two rollout
worker processes on Ray, each an hf engine of the tiny model that received its weights over the
transfer group from this process."""

from pathlib import Path

import numpy as np
import pytest
import torch

from engines.rollout.base import ROW_KEY, SamplingPosition, SeededGenerationMixin, chunk_seed, row_seed
from engines.rollout.config import RolloutConfig
from hybridflow.protocol import DataProto, DataProtoConfig, pad_dataproto_to_divisor
from hybridflow.trainer.policy import Policy
from hybridflow.trainer.rollout.pool import PoolRollout

SEED = 7


class SeedingEngine(SeededGenerationMixin):
    """The engines' seeding rules alone: a call's rows and the seed each is sampled with."""

    def __init__(self, n: int = 1):
        self.cfg = RolloutConfig(seed=SEED, max_engine_restarts=0)
        self.cfg.sampling.n = n
        self.position = SamplingPosition()

    def row_seeds(self, chunk: DataProto) -> tuple[DataProto, list[int]]:
        prompts, _, seed = self.start_call(chunk)
        return prompts, [row_seed(seed, row) for row in range(len(prompts))]


def prompt_rows(rows: int) -> DataProto:
    ids = torch.arange(rows * 3).reshape(rows, 3) + 3  # (B, 3)
    tensors = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "position_ids": torch.arange(3).repeat(rows, 1),
    }
    return DataProto.from_dict(tensors)


def pool_seeds(rows: DataProto, processes: int, n: int = 1) -> list[int]:
    """Per output row, the seed it is sampled with when the pool's call is split as dispatch splits
    it over `processes` (padded to a multiple, the padding rows' outputs dropped)."""
    pool = PoolRollout(
        group=None, output_dir=".", rollout_cfg=RolloutConfig(seed=SEED, max_engine_restarts=0)
    )
    padded, padding = pad_dataproto_to_divisor(pool.seeded(rows), processes)
    seeds = []
    for chunk in padded.chunk(processes):
        seeds += SeedingEngine(n).row_seeds(chunk)[1]
    return seeds[: len(seeds) - padding * n]


def test_a_chunk_seed_shifts_the_row_seeds_by_the_chunks_first_row():
    for seed in (0, 1, SEED, 2**62 - 1, 10**30):
        assert chunk_seed(seed, 0) == seed
        for first, row in ((1, 0), (4, 3), (1000, 17), (2**40, 5)):
            assert row_seed(chunk_seed(seed, first), row) == row_seed(seed, first + row)
            assert 0 <= chunk_seed(seed, first) < 2**62


def test_the_samples_of_one_prompt_over_two_processes_get_distinct_seeds():
    """4 prompts x 4 samples on 2 processes (the repeat is the driver's): before, row j of each
    chunk had the seed of row j of the other."""
    rows = prompt_rows(4).repeat(4, interleave=True)
    seeds = pool_seeds(rows, processes=2)
    assert len(set(seeds)) == len(seeds) == 16


@pytest.mark.parametrize("rows, n", [(16, 1), (5, 1), (3, 4)])
def test_a_calls_row_seeds_are_the_same_on_one_two_and_three_processes(rows, n):
    """Each row's seed is row_seed(call seed, its index in the call's output), however the call is
    split (uneven lengths padded; with n samples per row drawn by the engine, output row i*n+k)."""
    expected = [row_seed(SEED, row) for row in range(rows * n)]
    for processes in (1, 2, 3):
        assert pool_seeds(prompt_rows(rows), processes, n) == expected, processes


def test_the_row_index_stays_out_of_the_engines_output():
    pool = PoolRollout(
        group=None, output_dir=".", rollout_cfg=RolloutConfig(seed=SEED, max_engine_restarts=0)
    )
    seeded = pool.seeded(prompt_rows(4))
    assert np.array_equal(seeded.non_tensor_batch[ROW_KEY], np.arange(4))
    second = seeded.chunk(2)[1]
    prompts, _ = SeedingEngine().row_seeds(second)
    assert ROW_KEY not in prompts.non_tensor_batch
    assert np.array_equal(second.non_tensor_batch[ROW_KEY], [2, 3])  # the caller's rows untouched


# ---------------------------------------------------------------------- the pool on Ray
class Sender:
    """The policy's side of the transfer group (the actor's rank 0 in a run): the tiny model's own
    weights as the version asked, sent by the real WeightSender over gloo from this process."""

    def __init__(self, model_dir: str):
        from transformers import AutoModelForCausalLM

        from engines.rollout.hf_rollout import checkpoint_tensors

        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.tensors = [(name, t.detach().contiguous()) for name, t in checkpoint_tensors(model).items()]
        self.sender = self.store = None

    def transfer_address(self) -> tuple[str, int]:
        """The rendezvous store this process hosts from now on, as the actor's rank 0 does."""
        from engines.weight_sync.transfer import sender_store

        self.store = sender_store("127.0.0.1", timeout_s=300)
        return "127.0.0.1", self.store.port

    def join_transfer(self, host: str, port: int, size: int) -> None:
        from engines.weight_sync.transfer import WeightSender, transfer_group

        group = transfer_group(host, port, 0, size, "gloo", timeout_s=300, store=self.store)
        self.sender = WeightSender(group, bucket_mb=1)

    def send_weights(self, version: int) -> None:
        self.sender.send(iter(self.tensors), version)

    def leave_transfer(self) -> None:
        if self.sender is not None:
            self.sender.group.close()
        self.sender = None


@pytest.fixture(scope="module", params=["hf", "vllm"])
def two_process_pool(request, ray_cluster, tmp_path_factory, module_in_quickstart_working_tree):
    """A rollout pool of 2 processes (hf or vLLM engines of the tiny model) serving version 1."""
    from hybridflow.config.loader import load_recipe
    from hybridflow.single_controller import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
    from hybridflow.trainer.rollout.pool import connect_transfer
    from hybridflow.utils.tiny_model import make_tiny_model
    from hybridflow.workers.rollout_worker import RolloutWorker

    root = tmp_path_factory.mktemp(f"pool_seeds_{request.param}")
    model = str(make_tiny_model(root / "tiny", num_layers=2))
    overrides = [
        f"model.path={model}",
        f"rollout.name={request.param}",
        "rollout.response_length=12",
        f"rollout.seed={SEED}",
    ]
    cfg = load_recipe(Path(__file__).resolve().parents[2] / "recipes/quickstart.yaml", overrides)
    resources = RayResourcePool([2], name_prefix=f"pool_seeds_{request.param}")
    group = RayWorkerGroup(resources, RayClassWithInitArgs(RolloutWorker, cfg))
    sender = Sender(model)
    try:
        group.init_model()
        connect_transfer(sender, group)
        policy = Policy(sender)
        policy.version = 1
        pool = PoolRollout(group, str(root), cfg.rollout)
        pool.engine_name = request.param  # what the tests below ask of the pool
        pool.sync_weights(policy)
        yield pool
    finally:
        sender.leave_transfer()
        group.shutdown()
        resources.release()


def one_group(samples: int, seed: int | None = None) -> DataProto:
    """One prompt's rows, repeated by the driver (n=1 for the engine), with `seed` when given."""
    rows = prompt_rows(1).repeat(samples, interleave=True)
    rows.meta_info.update({"n": 1} if seed is None else {"n": 1, "seed": seed})
    return rows


@pytest.mark.slow
def test_a_group_spread_over_two_rollout_processes_holds_distinct_samples(two_process_pool):
    """1 prompt x 4 samples at temperature 1 on 2 processes: rows 0-1 on one, 2-3 on the other.
    With the same seed per chunk, the second process's two samples repeated the first's."""
    responses = two_process_pool.generate(one_group(4)).batch["responses"]  # (4, R)
    first, second = responses[:2], responses[2:]
    assert not torch.equal(first, second), responses
    assert len({tuple(row.tolist()) for row in responses}) == 4, responses


@pytest.mark.slow
def test_a_call_samples_the_same_on_one_process_as_split_over_two(two_process_pool):
    """vLLM seeds each request: the call's rows get the same samples whether one process generates
    them all or each of two generates half, the seed given being the same."""
    import ray

    if two_process_pool.engine_name == "hf":
        pytest.skip("the hf engine samples a chunk as one batch from one seed: samples depend on the split")
    split = two_process_pool.generate(one_group(4, seed=11)).batch["responses"]  # (4, R): 2 + 2
    whole = two_process_pool.seeded(one_group(4, seed=11))
    alone = ray.get(two_process_pool.group.actors[0].generate_sequences.remote(whole)).batch["responses"]
    assert torch.equal(split, alone), (split, alone)
    assert len({tuple(row.tolist()) for row in alone}) == 4, alone


@pytest.mark.slow
def test_a_call_the_processes_do_not_divide_answers_each_row_once(two_process_pool):
    """5 rows on 2 processes: the call is padded with a copy of its first row for the split, and the
    copy's answer dropped; the answer asks no later call to pad (a training step pads nothing)."""
    rows = one_group(5)
    answer = two_process_pool.generate(rows)
    assert torch.equal(answer.batch["prompts"], rows.batch["input_ids"])  # (5, P): each row once, in order
    assert len({tuple(row.tolist()) for row in answer.batch["responses"]}) == 5, answer.batch["responses"]
    assert DataProtoConfig.auto_padding_key not in answer.meta_info
