"""Partial rollouts: a weight update lands mid-generation, the in-flight requests continue under
the new weights keeping their tokens, every token records the version that sampled it and its
log-prob under that version, and the off-policy correction uses those per-token log-probs.

The engine runs in `_partial_worker.py` (vLLM real, CPU build, in its own process); the
log-probs it recorded are checked here against transformers on the same weights."""

import functools
import os
import sys
from pathlib import Path

import pytest
import torch
from _partial_worker import MAX_NEW_TOKENS, PROMPTS, SWITCH_AT
from _transfer_worker import versioned_tensors
from process_group import run_in_own_session

from engines.rollout.partial import Segment, boundary_window_open, continuation, stop_across_boundary
from hybridflow.trainer.rollout.pool import mixed_version_share
from hybridflow.utils.tiny_model import make_tiny_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "megatron"))
from tiny_hf import ascii_vocab_size

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("_partial_worker.py")
LOG_PROB_TOLERANCE = 1e-4  # vLLM's CPU kernels vs transformers, both fp32


def test_a_continuation_keeps_the_tokens_and_what_is_left_of_the_budget():
    segment = continuation([5, 6], [7, 8, 9], max_new_tokens=10, seed=3)
    assert segment.prompt_ids == [5, 6, 7, 8, 9] and segment.max_new_tokens == 7
    assert segment.seed != 3  # the request's own seed would replay its first draws
    assert continuation([5], [7], 10, 3).seed != segment.seed
    assert continuation([5, 6], [], 10, 3) == Segment([5, 6], 10, 3)  # nothing sampled yet: as it was
    with pytest.raises(ValueError, match="max_new_tokens=3"):
        continuation([5], [7, 8, 9], max_new_tokens=3, seed=3)


def test_a_stop_string_split_by_the_update_is_found():
    # "ab|cd": text before the boundary is "ab"
    assert stop_across_boundary("abcd", 2, ["bc"]) == 3
    assert stop_across_boundary("abcd", 2, ["zz", "abcd", "bc"]) == 3  # the earliest end
    assert stop_across_boundary("abcd", 2, ["ab"]) is None  # before: vLLM stopped on it already
    assert stop_across_boundary("abcd", 2, ["cd"]) is None  # after: vLLM's own segment sees it
    assert stop_across_boundary("abcdbc", 3, ["bc"]) is None  # occurrences on either side only
    assert boundary_window_open(1, ["abc"]) and not boundary_window_open(2, ["abc"])


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    """The shared tiny model, emitting only one-character tokens (and special tokens): the stop
    string around the boundary is then made of the tokens on either side of it."""
    return str(make_tiny_model(tmp_path_factory.mktemp("partial") / "tiny", vocab_size=ascii_vocab_size()))


@pytest.fixture(scope="module")
def runs(model_dir, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("partial_out") / "runs.pt"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "2", "PYTHONWARNINGS": "ignore"}
    command = [sys.executable, str(WORKER), model_dir, str(out)]
    done = run_in_own_session(command, cwd=ROOT, env=env, timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    return torch.load(out)


@functools.cache
def hf_model(model_dir: str, version: int):
    """transformers' model of `versioned_tensors(version)`, fp32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    loaded = model.load_state_dict(dict(versioned_tensors(model_dir, version)), strict=False)
    assert not loaded.unexpected_keys, loaded.unexpected_keys
    return model


def hf_log_probs(model_dir: str, version: int, prompt: list[int], response: list[int]) -> torch.Tensor:
    """log p(response[t] | prompt, response[:t]) under `versioned_tensors(version)`, (R,)."""
    ids = torch.tensor([prompt + response])  # (1, P + R)
    with torch.no_grad():
        logits = hf_model(model_dir, version)(ids).logits[0, len(prompt) - 1 : -1]  # (R, V): the responses
    return torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(response)[:, None])[:, 0]


@pytest.mark.slow
def test_tokens_of_two_versions_each_with_its_own_log_probs(runs, model_dir):
    for row, (done, reference) in enumerate(zip(runs["partial"], runs["reference"], strict=True)):
        before = runs["partial_seen"]["before"][row]
        a = len(before)
        assert a >= SWITCH_AT and done["versions"] == [0] * a + [1] * (MAX_NEW_TOKENS - a), done["versions"]
        assert done["finish_reason"] == "length" and len(done["token_ids"]) == MAX_NEW_TOKENS
        # the tokens before the switch are unchanged, and are what an uninterrupted request samples
        assert done["token_ids"][:a] == before == reference["token_ids"][:a]
        assert done["log_probs"][:a] == reference["log_probs"][:a]
        rollout = torch.tensor(done["log_probs"])  # (R,)
        v0 = hf_log_probs(model_dir, 0, PROMPTS[row], done["token_ids"])
        v1 = hf_log_probs(model_dir, 1, PROMPTS[row], done["token_ids"])
        assert (rollout[:a] - v0[:a]).abs().max() < LOG_PROB_TOLERANCE, (rollout[:a] - v0[:a]).abs().max()
        assert (rollout[a:] - v1[a:]).abs().max() < LOG_PROB_TOLERANCE, (rollout[a:] - v1[a:]).abs().max()
        assert (rollout[a:] - v0[a:]).abs().max() > 100 * LOG_PROB_TOLERANCE  # the versions are told apart


@pytest.mark.slow
def test_the_correction_weighs_each_token_by_its_own_behaviour_policy(runs, model_dir):
    """The batch of the partial run trained on by the version-1 actor: decoupled PPO's weights
    pi_old / mu are 1 on the version-1 tokens and pi_1 / pi_0 on the version-0 ones."""
    from engines.megatron.actor import off_policy_correction
    from hybridflow.algorithms.rollout_correction import RolloutCorrectionConfig
    from hybridflow.protocol import DataProto

    done = runs["partial"]
    old, v0 = (
        torch.stack([hf_log_probs(model_dir, v, PROMPTS[row], c["token_ids"]) for row, c in enumerate(done)])
        for v in (1, 0)
    )  # (B, R) each
    rollout = torch.tensor([c["log_probs"] for c in done])  # (B, R)
    versions = torch.tensor([c["versions"] for c in done])  # (B, R)
    batch = {"old_log_probs": old, "rollout_log_probs": rollout, "response_mask": torch.ones_like(rollout)}
    data = DataProto.from_dict(batch)
    off_policy_correction(data, RolloutCorrectionConfig(mode="decoupled_ppo", upper=None))
    weights = data.batch["is_weights"]  # (B, R)
    expected = torch.where(versions == 1, torch.ones_like(old), (old - v0).exp())
    assert torch.allclose(weights, expected, rtol=1e-3), (weights - expected).abs().max()
    assert (weights[versions == 0] - 1).abs().max() > 1e-2  # the version-0 tokens are off-policy


@pytest.mark.slow
def test_a_stop_string_split_by_the_update_ends_the_request(runs, model_dir):
    """`stop` is `split` again with a stop string made of the characters on either side of the
    update: it ends at the first token after the update, as one uninterrupted request would."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    split, stop, before = runs["split"], runs["stop"], runs["split_seen"]["before"][0]
    boundary = len(tokenizer.decode(before))
    text = tokenizer.decode(split["token_ids"])
    # the run is seeded: the stop string occurs first where the update split it
    assert text.find(runs["stop_string"]) == boundary - 1 and len(runs["stop_string"]) == 2, (text, boundary)
    after = range(len(before) + 1, len(split["token_ids"]) + 1)
    end = next(k for k in after if len(tokenizer.decode(split["token_ids"][:k])) > boundary)  # tokens
    assert stop["finish_reason"] == "stop" and stop["token_ids"] == split["token_ids"][:end], stop
    assert stop["versions"] == [0] * len(before) + [1] * (end - len(before))


@pytest.mark.slow
def test_without_partial_rollouts_the_update_waits_for_the_requests(runs):
    (done,) = runs["drain"]
    assert runs["drain_seen"]["at_load"] == 0  # nothing in flight when the weights loaded
    assert done["versions"] == [1] * MAX_NEW_TOKENS and done["finish_reason"] == "length"
    assert runs["drain_version"] == 2


@pytest.mark.slow
def test_a_batch_through_requests_is_the_batch_paths_batch(runs):
    """RequestBatches, no update: what the engine's own generate_sequences gives, every token of
    version 0 (-1 on the padding after a row that ended early)."""
    batch_path, batches = runs["batch_path"], runs["batches"]
    for key, value in batch_path.items():
        assert torch.allclose(batches[key], value, rtol=0, atol=1e-6), key
    sampled = batches["response_mask"] == 1  # (B, R)
    assert torch.equal(batches["rollout_versions"], torch.where(sampled, 0, -1))
    assert batches["policy_version"].tolist() == [0, 0]


@pytest.mark.slow
def test_a_batch_split_by_an_update_records_the_version_of_every_token(runs):
    """RequestBatches with an update submitted from another thread mid-call: each row continues
    under version 1 keeping its version-0 tokens, which are those of the uninterrupted call; the
    row's version is that of its oldest token."""
    split, reference = runs["batches_split"], runs["batches"]
    assert runs["batches_split_version"] == 1
    for row, seen in enumerate(runs["batches_seen"]):
        versions = split["rollout_versions"][row].tolist()
        a, length = versions.count(0), int(split["response_mask"][row].sum())
        assert SWITCH_AT <= seen <= a < length, (seen, versions)
        assert versions == [0] * a + [1] * (length - a) + [-1] * (MAX_NEW_TOKENS - length)
        assert torch.equal(split["responses"][row, :a], reference["responses"][row, :a])
        assert torch.equal(split["rollout_log_probs"][row, :a], reference["rollout_log_probs"][row, :a])
    assert split["policy_version"].tolist() == [0, 0]
    assert mixed_version_share(split["rollout_versions"]) == 1.0
