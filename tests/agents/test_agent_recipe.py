"""recipes/gsm8k_tool_grpo.yaml runs two GRPO steps on CPU (in process, on this pytest worker's Ray
cluster: tests/recipe_runs.py), its
trajectories made by an agent written against the `openai` client (rollout.agent.loop: openai,
hybridflow/agents/openai_example.py) talking to the endpoint inside the Ray workers, over their
vLLM engines; the tiny model is fitted to call the calculator (tool_model.py), the reward is the
GSM8K rule on its question. (Sampled at temperature 1, the model rarely reaches its memorised
answer: the test is about the endpoint inside training, not learning. The tool loop trains in
test_tool_demo_learning.py.) The same runs with a LangGraph agent (_langgraph_agent.py), whose
module the workers import from this directory (the session cluster's workers have it on their
PYTHONPATH: tests/recipe_runs.py's WORKER_TEST_DIRS). And the OpenAI-client agent on a rollout pool
of two replicas (trainer.placement=disaggregated): the agents and their endpoint on the driver,
every session's requests routed to one replica, both replicas serving (router.jsonl)."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from recipe_runs import run_recipe_in_process
from tool_model import ANSWER, QUESTION


def write_rows(path, rows: int) -> str:
    row = {
        "prompt": [{"role": "user", "content": QUESTION}],
        "data_source": "openai/gsm8k",
        "reward_model": {"ground_truth": ANSWER},
    }
    pq.write_table(pa.Table.from_pylist([row] * rows), path)
    return str(path)


AGENTS = {
    "openai_client": "hybridflow.agents.openai_example:calculator_agent",
    "langgraph": "_langgraph_agent:run",
}
# the agents on the driver, each session's requests routed to one of two vLLM replicas
POOL = (
    "trainer.placement=disaggregated",
    "trainer.n_gpus_per_node=1",
    "trainer.rollout_pool.n_gpus_per_node=2",
)
CASES = {
    "openai_client": ("openai_client", ()),
    "langgraph": ("langgraph", ()),
    "openai_client-on_a_pool": ("openai_client", POOL),
}


@pytest.mark.slow
@pytest.mark.usefixtures("ray_cluster")
@pytest.mark.parametrize("case", CASES)
def test_tool_grpo_recipe_runs_two_steps_with_an_openai_client_agent(case, tool_model, tmp_path):
    agent, placement = CASES[case]
    train, val = write_rows(tmp_path / "train.parquet", 8), write_rows(tmp_path / "val.parquet", 2)
    overrides = [
        f"model.path={tool_model}",
        f"data.train_files=[{train}]",
        f"data.val_files=[{val}]",
        "data.max_prompt_length=64",
        "data.train_batch_size=2",
        "actor.megatron.tensor_model_parallel_size=1",
        "actor.megatron.params_dtype=float32",
        "actor.update.use_dynamic_bsz=false",
        "actor.update.ppo_mini_batch_size=4",
        "actor.update.ppo_micro_batch_size=2",
        "actor.log_prob_micro_batch_size=2",
        "ref.log_prob_micro_batch_size=2",
        "rollout.dtype=float32",
        "rollout.response_length=200",
        "rollout.sampling.n=2",
        "rollout.agent.loop=openai",
        "rollout.agent.tools=[]",  # the agent offers the calculator itself
        f"rollout.agent.openai_agent={AGENTS[agent]}",
        "trainer.use_gpu=false",
        "trainer.n_gpus_per_node=2",
        "trainer.total_training_steps=2",
        "trainer.val_before_train=false",
        "trainer.test_freq=2",
        "trainer.save_freq=0",
        "trainer.logger=[console]",
        f"trainer.output_dir={tmp_path / 'out'}",
        *placement,
    ]
    done = run_recipe_in_process("recipes/gsm8k_tool_grpo.yaml", overrides)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    records = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r.get("step") in (1, 2) and "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    first = steps[0]
    # the fitted model calls the calculator (twice in its memorised answer) in most trajectories
    assert first["agent/tool_calls/mean"] > 0.5 and first["agent/turns/mean"] > 1.5, first
    assert first["agent/tool_tokens/mean"] > 0 and 0.0 <= first["reward/mean"] <= 1.0, first
    assert "val/accuracy" in steps[-1]
    if placement:  # every session's requests on one replica (none died), both replicas serving
        routes = [json.loads(line) for line in (tmp_path / "out" / "router.jsonl").read_text().splitlines()]
        replicas = {}
        for route in routes:
            replicas.setdefault(route["session"], set()).add(route["replica"])
        assert len(replicas) == 2 * 4 + 2, routes  # two steps' sessions, then validation's
        assert all(len(on) == 1 for on in replicas.values()), routes
        assert set.union(*replicas.values()) == {0, 1} and not any(route["moved"] for route in routes)
        assert 0.0 <= first["rollout/prefix_cache_hit_rate"] <= 1.0, first
