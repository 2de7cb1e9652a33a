"""A rollout pool of 3 vLLM CPU processes (trainer.placement=disaggregated, actor 1 process, through
scripts/run_recipe.sh) whose processes are SIGKILLed inside a generation, a checkpoint save
and a weight transfer, in each async mode (sync, one_step, async with partial rollouts, stream), and
a run that goes on. The condition, not a timing: the run's processes load held_calls/sitecustomize.py,
with which a process announces a chosen call and holds it (a generation once it has run), so the
kill lands inside it.

- Inside step 1's generation (the first call of `generate_sequences` in any process, its tokens
  generated, its answer not returned): the pool restarts the process with the policy's weights
  (checked against the actor's log-probs) and generates the lost rows again with their seed. In
  stream mode every group's call is held until that restart, or the other processes' groups could
  fill step 1 before the lost call is met, and the death would fall in the next kill's save.
- Inside the checkpoint save after step 1 (`save_rng_state`, the sampling positions): the other
  processes' saves go through; the pool restarts the dead one and saves every position again.
- Inside the next weight transfer after that restart (a receiver's `load_into`, the actor's sender
  streaming buckets to every process): the sender's collective fails, the survivors' receives
  under way fail with it and are dropped, the dead process is restarted and the transfer made
  again to all.

Every run finishes its 3 steps with a restart for each kill (`rollout/engine_restarts` [1, 2, 3]),
trains 4 whole groups of 2 samples a step, none staler than its mode allows (policy_versions.jsonl);
every step's checkpoint has every process's sampling position; nothing of the run is left running.
What each step trained on (trainer.save_samples): every group whole and once, the groups of the
killed generation among them (generated again, not lost); where each step's prompts do not depend
on timing (sync, one_step, async: a batch a step) the prompts an unkilled run in the same mode
trains, step by step. Where the samples do not depend on timing either (sync, one_step) the killed
run trained exactly what the unkilled run trains: the same samples, metrics and sample versions.
The unkilled run is made once per mode, on a pool of 2: a seeded call's samples do not depend on
the number of processes (each row is seeded by its index in the call), so it is the reference (run
in the test's own process). A pool of 3 splits a step's 8 rows unevenly, and each kill leaves 2
survivors.
"""

import json
import subprocess
import uuid
from collections import Counter
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import pytest
from held_calls.control import held_environment, held_generation, holders, kill, release
from multinode_helpers import processes_with_env
from recipe_runs import run_recipe_in_process
from run_outputs import step_records, trained_steps, without_restarts, without_uids
from run_processes import cleanup, wait_for
from tiny_run import RECIPE, command, environment, overrides, tiny_run_inputs
from transformers import AutoTokenizer

from hybridflow.trainer.samples import read_samples

pytestmark = pytest.mark.slow

STEPS = 3
OVERRIDES = (
    "trainer.placement=disaggregated", "trainer.n_gpus_per_node=1",
    "actor.megatron.tensor_model_parallel_size=1",
    "rollout.name=vllm", f"trainer.total_training_steps={STEPS}", "trainer.save_freq=1",
    "trainer.max_ckpt_to_keep=null", "trainer.export_hf=false", "trainer.save_samples=true",
    # a transfer left blocked by the death ends the run well before the test's own deadline
    "rollout.weight_transfer_timeout_s=120",
)  # fmt: skip
# the first save of each process; a generation and a receive, each when the test arms it
HOLD = "generate_sequences:armed,save_rng_state:1,load_into:armed"
# in stream mode every group's generation, until the test lets them all go
HOLD_STREAM = "generate_sequences:every,save_rng_state:1,load_into:armed"


@pytest.fixture(scope="module")
def local(tmp_path_factory) -> dict:
    return tiny_run_inputs(tmp_path_factory.mktemp("pool_deaths"))


@pytest.fixture(scope="module")
def tokenizer(local):
    return AutoTokenizer.from_pretrained(local["model"])


@pytest.fixture(scope="module")
def unkilled(local, ray_cluster, tmp_path_factory) -> Callable[[str], Path]:
    """The output of an unkilled run in a mode on a pool of 2, run once per mode for the module. It
    is the reference only, so it runs in the test's own process (tests/recipe_runs.py)."""
    outputs: dict[str, Path] = {}

    def output(mode: str) -> Path:
        if mode not in outputs:
            out = tmp_path_factory.mktemp(f"unkilled_{mode}") / "run"
            pool = ("trainer.rollout_pool.n_gpus_per_node=2", *MODES[mode])
            done = run_recipe_in_process(
                RECIPE, overrides(local, out, *OVERRIDES, *pool), pythonpath=local["root"]
            )
            assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
            outputs[mode] = out
        return outputs[mode]

    return output


@contextmanager
def running(local: dict, out: Path, hold: Path, calls: str, *overrides: str):
    """The run, its `calls` held in `hold`; stopped with every process of it when the block ends."""
    hold.mkdir()
    marker = uuid.uuid4().hex
    env = held_environment(hold, calls, local["root"])
    with open(out.parent / f"{out.name}.log", "w") as log:
        proc = subprocess.Popen(
            command(local, out, *OVERRIDES, *overrides), env=environment(local, marker, **env),
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        try:
            yield proc
            assert proc.wait(timeout=900) == 0, (out.parent / f"{out.name}.log").read_text()[-4000:]
            assert processes_with_env(f"HYBRIDFLOW_TEST_RUN={marker}") == []
        finally:
            cleanup(proc, marker)


KEY = "trainer.async_training"
OFF_POLICY = ("rollout.calculate_log_probs=true", "algorithm.rollout_correction.mode=decoupled_ppo")
MODES = {
    "sync": (),
    "one_step": (f"{KEY}.mode=one_step",),
    "async_partial": (
        f"{KEY}.mode=async",
        f"{KEY}.max_staleness=2",
        f"{KEY}.partial_rollout=true",
        *OFF_POLICY,
    ),
    "stream": (f"{KEY}.mode=stream", f"{KEY}.max_staleness=1", *OFF_POLICY),
}
BOUND = {"sync": 0, "one_step": 1, "async_partial": 2, "stream": 1}
PROCESSES = 3  # the killed runs' pool
# where the samples do not depend on timing, the killed run must train what an unkilled one does
DETERMINISTIC = ("sync", "one_step")
# where each step's prompts do not depend on timing (a batch a step), only the responses may
SAME_PROMPTS = ("sync", "one_step", "async_partial")


def kill_inside_a_generation(hold: Path, proc: subprocess.Popen, log: Path, mode: str) -> list[list[int]]:
    """Kill the process of step 1's first generation, its tokens generated, its answer not returned;
    the prompts (token ids) of the rows it lost."""
    if mode != "stream":
        (hold / "arm-generate_sequences").touch()
    generating, held = held_generation(hold, proc, "1" if mode == "stream" else "armed")
    kill(generating)
    if mode == "stream":  # every other group held until the pool restarted the process
        wait_for(
            lambda: "rollout pool: restarted process(es)" in log.read_text() or proc.poll() is not None,
            900, "the pool's restart of the process killed in its generation",
        )  # fmt: skip
        (hold / "release-generate_sequences").touch()
    return held["prompts"]


def kill_inside_a_generation_a_save_and_a_transfer(
    hold: Path, proc: subprocess.Popen, log: Path, mode: str, processes: int
) -> list[list[int]]:
    """The three kills; the prompts of the rows the generation's kill lost."""
    lost = kill_inside_a_generation(hold, proc, log, mode)
    first, *others = holders(hold, proc, "save_rng_state.1", count=processes)
    kill(first)
    for pid in others:  # their saves go through
        release(hold, "save_rng_state.1", pid)
    (restarted,) = holders(hold, proc, "save_rng_state.1", not_pids=(first, *others))
    # the restart's load of the weights is behind: the next receive is the next transfer's
    (hold / "arm-load_into").touch()
    release(hold, "save_rng_state.1", restarted)  # the positions saved again, the new process's too
    kill(holders(hold, proc, "load_into.armed")[0])
    (hold / "release").touch()  # every call from now on goes through
    return lost


@pytest.mark.parametrize("mode", MODES)
def test_processes_killed_inside_a_generation_a_save_and_a_transfer_are_restarted_and_the_run_trains_on(
    local, unkilled, tokenizer, tmp_path, mode
):
    killed, hold = tmp_path / "killed", tmp_path / "hold"
    pool = (f"trainer.rollout_pool.n_gpus_per_node={PROCESSES}", *MODES[mode])
    with running(local, killed, hold, HOLD_STREAM if mode == "stream" else HOLD, *pool) as proc:
        log = killed.parent / f"{killed.name}.log"
        lost = kill_inside_a_generation_a_save_and_a_transfer(hold, proc, log, mode, PROCESSES)
    records = step_records(killed)
    assert [r["rollout/engine_restarts"] for r in records] == [1, 2, 3]
    assert all(r.get("rollout/restart_log_prob_diff", 0.0) <= 1e-4 for r in records)
    for step in range(1, STEPS + 1):  # each step's checkpoint holds every process's position
        rollout = killed / "checkpoints" / f"global_step_{step}" / "rollout"
        assert sorted(p.name for p in rollout.glob("rank_*.pt")) == [f"rank_{r}.pt" for r in range(PROCESSES)]
    versions = [json.loads(line) for line in (killed / "policy_versions.jsonl").read_text().splitlines()]
    assert [v["trained_on"] for v in versions] == list(range(STEPS))
    assert [len(v["sample_versions"]) for v in versions] == [8] * STEPS  # 4 whole groups of 2 a step
    staleness = [v["trained_on"] - s for v in versions for s in v["sample_versions"]]
    assert all(0 <= s <= BOUND[mode] for s in staleness), versions
    for record in records:  # each process's share of the step, as the rows it generated say
        replicas = {int(key.split("/")[1].removeprefix("replica_")) for key in record if "/replica_" in key}
        assert replicas <= set(range(PROCESSES)), record
        assert sum(record[f"rollout/replica_{r}/samples"] for r in replicas) == 8, record
        assert 0.0 <= record["rollout/prefix_cache_hit_rate"] <= 1.0, record
    samples = read_samples(killed)  # trainer.save_samples: what each step trained on
    assert [len(step) for step in samples] == [8] * STEPS
    groups = Counter(record["uid"] for step in samples for record in step)
    assert set(groups.values()) == {2}, groups  # whole groups of 2, none trained twice
    trained = Counter(record["prompt"] for step in samples for record in step)
    lost_prompts = sorted({tokenizer.decode(ids) for ids in lost})
    assert [trained[prompt] for prompt in lost_prompts] == [2] * len(lost_prompts)  # generated again, trained
    if mode in SAME_PROMPTS:
        plain = unkilled(mode)
        assert [prompts(step) for step in samples] == [prompts(step) for step in read_samples(plain)]
    if mode in DETERMINISTIC:
        assert without_restarts(trained_steps(killed)) == without_restarts(trained_steps(plain))
        assert (killed / "policy_versions.jsonl").read_text() == (plain / "policy_versions.jsonl").read_text()
        assert [without_uids(step) for step in samples] == [
            without_uids(step) for step in read_samples(plain)
        ]


def prompts(step: list[dict]) -> list[str]:
    return sorted(record["prompt"] for record in step)
