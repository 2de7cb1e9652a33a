"""The Megatron training path gives the same update at every parallel layout, and the same update
as a single-process transformers step: PPO (clip-higher, dual clip, entropy bonus, KL loss),
critic, SFT, and distributed checkpoints saved at TP2 and loaded at TP1.

Sequence packing (THD) with token-budget micro-batches gives the same results as padding on a
batch with heavy-tailed (log-normal, capped) response lengths: log-probs, entropies, values,
reward scores and gradients at (TP, PP) in {1, 2}^2, and one PPO update at every layout.

Five torchrun launches (one per layout, several checks each; see _train_parity.py). Adam makes a
weight update nearly invariant to a uniform gradient scale, so the grad norms (which are not)
are compared too: they catch a wrong loss scale over micro-batches or data-parallel ranks and a
norm that counts tensor-parallel duplicates twice.
"""

import itertools

import pytest
import torch
from _train_settings import ACTOR_UPDATE, OPTIM, PACKED_BUDGET, SFT_STEPS, TEMPERATURE
from launch import run_distributed
from tiny_hf import make_tiny_hf_checkpoint, padded_batch

from hybridflow.algorithms import agg_loss, compute_policy_loss, kl_penalty

pytestmark = pytest.mark.slow

PACKED_TOKEN_MEAN = "heavy-actor:token-mean:packed"
PACKED_SEQ_MEAN = "heavy-actor:seq-mean-token-mean:packed"
# (tag, nproc, tp, pp, steps)
LAUNCHES = [
    ("tp2", 2, 2, 1, ["actor:token-mean", "critic", "save:ckpt_tp2", PACKED_TOKEN_MEAN, "packing",
                      "heavy-critic:packed"]),
    ("pp2", 2, 1, 2, ["actor:token-mean", PACKED_TOKEN_MEAN, "packing"]),
    ("dp2", 2, 1, 1, ["actor:seq-mean-token-mean", "critic", PACKED_SEQ_MEAN, PACKED_TOKEN_MEAN,
                      "heavy-critic:packed"]),
    ("tp2pp2", 4, 2, 2, ["actor:token-mean", PACKED_TOKEN_MEAN, "packing"]),
    ("tp1", 1, 1, 1, ["actor:token-mean", "actor:seq-mean-token-mean", "critic", "sft", "load:ckpt_tp2",
                      "heavy-actor:token-mean:padded", "heavy-actor:seq-mean-token-mean:padded",
                      "heavy-critic:padded", PACKED_TOKEN_MEAN, "packing"]),
]  # fmt: skip
PROMPT_LEN, RESPONSE_LEN, VOCAB = 6, 6, 200
HEAVY_RESPONSE_LEN = 32


def _response_log_probs_and_entropy(model, batch):
    response_len = batch["responses"].shape[1]
    logits = (
        model(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            position_ids=batch["position_ids"],
        ).logits[:, -response_len - 1 : -1]
        / TEMPERATURE
    )  # (B, R, V)
    log_probs = logits.log_softmax(-1)
    token_log_prob = log_probs.gather(-1, batch["responses"].unsqueeze(-1)).squeeze(-1)  # (B, R)
    entropy = -(log_probs.exp() * log_probs).sum(-1)  # (B, R)
    return token_log_prob, entropy


def heavy_tailed_lengths(rows: int, median: float, sigma: float, cap: int, seed: int) -> list[int]:
    """Response lengths from a log-normal (median `median`, log-std `sigma`), rounded, capped."""
    gen = torch.Generator().manual_seed(seed)
    draws = torch.exp(torch.log(torch.tensor(median)) + sigma * torch.randn(rows, generator=gen))
    return draws.round().clamp(max=cap).long().tolist()


def _make_batch(hf_dir, prompt_lengths=(3, 6, 2, 5, 4, 6, 1, 3), response_lengths=(6, 2, 4, 1, 0, 5, 3, 6),
                response_len=RESPONSE_LEN) -> dict[str, torch.Tensor]:  # fmt: skip
    """8 rows (by default responses of 6 down to 0 tokens); old / ref log-probs near the model's own."""
    from transformers import AutoModelForCausalLM

    batch = padded_batch(list(prompt_lengths), list(response_lengths), PROMPT_LEN, response_len, VOCAB, 1)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    with torch.no_grad():
        log_prob, _ = _response_log_probs_and_entropy(model, batch)
    gen = torch.Generator().manual_seed(2)
    mask = batch["response_mask"].float()
    batch["old_log_probs"] = log_prob + 0.3 * torch.randn(log_prob.shape, generator=gen)
    batch["ref_log_prob"] = log_prob + 0.2 * torch.randn(log_prob.shape, generator=gen)
    batch["advantages"] = torch.randn(log_prob.shape, generator=gen) * mask
    batch["values"] = 0.5 * torch.randn(log_prob.shape, generator=gen) * mask
    batch["returns"] = torch.randn(log_prob.shape, generator=gen) * mask
    return batch


def _reference_ppo(hf_dir, batch, mode: str):
    """Single-process transformers + torch AdamW version of the same update."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    params = list(model.parameters())
    groups = [  # Megatron-Core: no weight decay on biases and other 1-D parameters
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": OPTIM.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(
        groups, lr=OPTIM.lr, betas=(OPTIM.adam_beta1, OPTIM.adam_beta2), eps=OPTIM.adam_eps
    )
    mask, grad_norms, pg_losses = batch["response_mask"], [], []
    for step in range(ACTOR_UPDATE["ppo_epochs"]):
        for group in opt.param_groups:  # Megatron's linear decay from lr at step 0 to 0 at lr_decay_iters
            group["lr"] = OPTIM.lr * (1 - step / OPTIM.lr_decay_iters)
        log_prob, entropy = _response_log_probs_and_entropy(model, batch)
        pg_loss, *_ = compute_policy_loss(
            batch["old_log_probs"], log_prob, batch["advantages"], mask, ACTOR_UPDATE["clip_ratio_low"],
            ACTOR_UPDATE["clip_ratio_high"], ACTOR_UPDATE["clip_ratio_c"], mode,
        )  # fmt: skip
        kl = kl_penalty(log_prob, batch["ref_log_prob"], ACTOR_UPDATE["kl_loss_type"])
        loss = (
            pg_loss
            - ACTOR_UPDATE["entropy_coeff"] * agg_loss(entropy, mask, mode)
            + ACTOR_UPDATE["kl_loss_coef"] * agg_loss(kl, mask, mode)
        )
        opt.zero_grad()
        loss.backward()
        grad_norms.append(torch.nn.utils.clip_grad_norm_(params, OPTIM.clip_grad).item())
        pg_losses.append(pg_loss.item())
        opt.step()
    return {k: v.detach() for k, v in model.state_dict().items()}, grad_norms, pg_losses


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("train_parity")
    hf_dir = make_tiny_hf_checkpoint(root / "hf", num_layers=4, vocab_size=VOCAB, seed=3)
    batch = _make_batch(hf_dir)
    torch.save(batch, root / "batch.pt")
    heavy_lengths = heavy_tailed_lengths(8, median=4.0, sigma=1.0, cap=HEAVY_RESPONSE_LEN, seed=4)
    heavy = _make_batch(hf_dir, [2, 6, 5, 1, 3, 6, 4, 2], heavy_lengths, HEAVY_RESPONSE_LEN)
    torch.save(heavy, root / "heavy.pt")
    for tag, nproc, tp, pp, steps in LAUNCHES:
        run_distributed("_train_parity.py", nproc, root, tp, pp, tag, *steps, timeout=240)
    results = {tag: torch.load(root / f"{tag}.pt") for tag, *_ in LAUNCHES}
    return {"root": root, "hf": hf_dir, "batch": batch, "heavy": heavy, **results}


def _assert_weights_close(actual: dict, expected: dict, rtol=1e-5, atol=1e-5):
    """atol is 1% of one Adam step (lr 1e-3): a real error moves a weight by about a step."""
    assert sorted(actual) == sorted(expected)
    for name in expected:
        torch.testing.assert_close(
            actual[name], expected[name], rtol=rtol, atol=atol, msg=lambda m, n=name: f"{n}: {m}"
        )


def _assert_metrics_close(actual: dict, expected: dict, keys, rtol=1e-4, atol=1e-7):
    for key in keys:
        assert actual[key] == pytest.approx(expected[key], rel=rtol, abs=atol), key


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_single_rank_update_matches_transformers_reference(runs, mode):
    weights, grad_norms, pg_losses = _reference_ppo(runs["hf"], runs["batch"], mode)
    result = runs["tp1"][f"actor:{mode}"]
    _assert_weights_close(result["weights"], weights)
    assert result["metrics"]["grad_norm"] == pytest.approx(grad_norms, rel=1e-4)
    assert result["metrics"]["pg_loss"] == pytest.approx(pg_losses, rel=1e-4, abs=1e-7)
    assert grad_norms[0] > OPTIM.clip_grad  # the clipping path was exercised
    assert result["metrics"]["lr"] == pytest.approx([OPTIM.lr, 0.9 * OPTIM.lr])


@pytest.mark.parametrize(
    ("tag", "step"),
    [("tp2", "actor:token-mean"), ("pp2", "actor:token-mean"), ("tp2pp2", "actor:token-mean"),
     ("dp2", "actor:seq-mean-token-mean")],
)  # fmt: skip
def test_policy_update_is_the_same_at_every_layout(runs, tag, step):
    expected, actual = runs["tp1"][step], runs[tag][step]
    _assert_weights_close(actual["weights"], expected["weights"])
    keys = ["grad_norm", "pg_loss", "pg_clipfrac", "ppo_kl", "entropy", "kl_loss", "lr"]
    _assert_metrics_close(actual["metrics"], expected["metrics"], keys)


@pytest.mark.parametrize("tag", ["tp2", "dp2"])
def test_critic_update_is_the_same_at_tp2_and_dp2(runs, tag):
    expected, actual = runs["tp1"]["critic"], runs[tag]["critic"]
    _assert_weights_close(actual["weights"], expected["weights"])
    _assert_metrics_close(
        actual["metrics"], expected["metrics"], ["vf_loss", "vf_clipfrac", "vpred_mean", "grad_norm"]
    )
    if tag == "tp2":  # dp2's values come from its own half of the batch
        torch.testing.assert_close(actual["values"], expected["values"], rtol=1e-5, atol=1e-6)
    assert expected["metrics"]["vf_loss"][1] < expected["metrics"]["vf_loss"][0]


def test_critic_values_cover_response_positions_only(runs):
    values, mask = runs["tp1"]["critic"]["values"], runs["batch"]["response_mask"]
    assert values.shape == mask.shape
    assert torch.all(values[mask == 0] == 0) and torch.all(values[mask == 1] != 0)


def test_sft_loss_decreases_on_a_memorisable_batch(runs):
    losses = [m["sft_loss"] for m in runs["tp1"]["sft"]["metrics"]]
    assert len(losses) == SFT_STEPS
    assert all(b < a for a, b in itertools.pairwise(losses))
    assert losses[-1] < 0.6 * losses[0]


def test_checkpoint_saved_at_tp2_loads_at_tp1(runs):
    saved = runs["tp2"]["actor:token-mean"]["weights"]
    for name, tensor in runs["tp1"]["loaded"]["weights"].items():
        assert torch.equal(tensor, saved[name]), name
    # the next step needs the restored Adam moments and LR schedule to agree
    _assert_weights_close(runs["tp1"]["after_load"]["weights"], runs["tp2"]["after_save"]["weights"])
    _assert_metrics_close(
        runs["tp1"]["after_load"]["metrics"], runs["tp2"]["after_save"]["metrics"], ["grad_norm", "lr"]
    )
    assert runs["tp2"]["after_save"]["metrics"]["lr"] == pytest.approx([0.8 * OPTIM.lr, 0.7 * OPTIM.lr])
    moved = [n for n in saved if not torch.allclose(saved[n], runs["tp1"]["after_load"]["weights"][n])]
    assert moved, "the step after loading changed no weight"


def test_heavy_batch_is_heavy_tailed_and_fits_the_budget(runs):
    lengths = runs["heavy"]["response_mask"].sum(-1)
    assert lengths.max() == HEAVY_RESPONSE_LEN and lengths.max() >= 4 * lengths.float().median()
    assert runs["heavy"]["attention_mask"].sum(-1).max() <= PACKED_BUDGET


@pytest.mark.parametrize("tag", ["tp1", "tp2", "pp2", "tp2pp2"])
def test_packed_forward_and_gradients_equal_padded(runs, tag):
    result, mask = runs[tag]["packing"], runs["heavy"]["response_mask"].bool()
    padded, packed = result["padded"], result["packed"]
    assert result["num_micro_batches"] >= 3  # several token-budget micro-batches, not one
    for key in ("log_probs", "entropys", "values"):
        torch.testing.assert_close(packed[key][mask], padded[key][mask], rtol=1e-5, atol=1e-5)
    assert torch.all(packed["values"][~mask] == 0)
    torch.testing.assert_close(packed["scores"], padded["scores"], rtol=1e-5, atol=1e-5)
    _assert_weights_close(packed["grads"], padded["grads"])
    assert any(g.abs().max() > 1e-3 for g in padded["grads"].values())


@pytest.mark.parametrize(
    ("tag", "step"),
    [("tp1", PACKED_TOKEN_MEAN), ("tp2", PACKED_TOKEN_MEAN), ("pp2", PACKED_TOKEN_MEAN),
     ("dp2", PACKED_TOKEN_MEAN), ("dp2", PACKED_SEQ_MEAN), ("tp2pp2", PACKED_TOKEN_MEAN)],
)  # fmt: skip
def test_packed_token_budget_update_equals_padded_fixed_micro_batches(runs, tag, step):
    expected = runs["tp1"][step.replace(":packed", ":padded")]
    actual = runs[tag][step]
    _assert_weights_close(actual["weights"], expected["weights"])
    keys = ["grad_norm", "pg_loss", "pg_clipfrac", "ppo_kl", "entropy", "kl_loss", "lr"]
    # pg_loss (~3e-3) is a mean of O(1) per-token terms that cancel: fp32 order changes it by ~3e-7
    _assert_metrics_close(actual["metrics"], expected["metrics"], keys, atol=1e-6)


@pytest.mark.parametrize("tag", ["tp2", "dp2"])
def test_packed_critic_update_equals_padded(runs, tag):
    expected, actual = runs["tp1"]["heavy-critic:padded"], runs[tag]["heavy-critic:packed"]
    _assert_weights_close(actual["weights"], expected["weights"])
    _assert_metrics_close(
        actual["metrics"], expected["metrics"], ["vf_loss", "vf_clipfrac", "vpred_mean", "grad_norm"]
    )
