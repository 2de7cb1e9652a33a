"""Every registered policy loss trains two GRPO steps of the tiny model through the whole loop (Ray
workers, the Megatron actor, the transformers rollout), and so does a user's loss from a file, named
by dotted path and imported by the actor's processes."""

import pytest
from recipe_runs import run_recipe_in_process
from two_grpo_steps import small_run, trained_steps

from hybridflow.algorithms import POLICY_LOSSES

# knobs a loss cannot run without
REQUIRED = {"dro": ["actor.update.dro_beta=0.1"]}

USER_LOSS = """
import torch

from hybridflow.algorithms import POLICY_LOSS_FNS


def marked_reinforce(
    old_log_prob, log_prob, advantages, response_mask, config, loss_agg_mode, global_token_count,
    global_seq_count, is_weights=None,
):
    loss, _, ppo_kl, lower = POLICY_LOSS_FNS["reinforce"](
        old_log_prob, log_prob, advantages, response_mask, config, loss_agg_mode, global_token_count,
        global_seq_count, is_weights,
    )
    return loss, torch.tensor(0.375), ppo_kl, lower  # a clip fraction no built-in loss reports
"""


@pytest.mark.slow
@pytest.mark.parametrize("loss", POLICY_LOSSES)
def test_a_registered_loss_trains_two_grpo_steps(loss, gsm8k_local, tmp_path):
    overrides = [
        *small_run(gsm8k_local, tmp_path),
        f"actor.update.policy_loss={loss}",
        *REQUIRED.get(loss, []),
    ]
    result = run_recipe_in_process("recipes/gsm8k_grpo.yaml", overrides, pythonpath=gsm8k_local["root"])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    trained_steps(tmp_path)


@pytest.mark.slow
def test_a_users_loss_from_a_file_trains_two_grpo_steps(gsm8k_local, worker_modules, tmp_path):
    """The actor's Ray workers import the loss: its file lies in conftest's `worker_modules`, a
    directory on their PYTHONPATH."""
    (worker_modules / "my_losses.py").write_text(USER_LOSS)
    overrides = [
        *small_run(gsm8k_local, tmp_path / "run"),
        "actor.update.policy_loss=my_losses.marked_reinforce",
    ]
    pythonpath = [worker_modules, gsm8k_local["root"]]  # the loss, and the runs' reward module
    result = run_recipe_in_process("recipes/gsm8k_grpo.yaml", overrides, pythonpath=pythonpath)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    # the clip fraction only the user's function reports: it computed the loss in the workers
    assert all(r["actor/pg_clipfrac"] == pytest.approx(0.375) for r in trained_steps(tmp_path / "run"))
