"""The registered policy losses against values and gradients worked out by hand from each paper's
formula; the registry (names, signature, a user's loss by dotted path) and its check before Ray."""

import math
import typing
from pathlib import Path

import pytest
import torch

from engines.megatron.config import ActorUpdateConfig
from hybridflow.algorithms import POLICY_LOSS_FNS, agg_loss, compute_policy_loss, compute_policy_loss_gspo
from hybridflow.algorithms.policy_losses import (
    POLICY_LOSS_PARAMETERS,
    check_policy_loss_signature,
    policy_loss_fn,
)
from hybridflow.trainer import main as entry
from hybridflow.utils.imports import DottedPathError
from hybridflow.utils.tiny_model import make_tiny_model

ROOT = Path(__file__).resolve().parents[1]
log = math.log


def sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def run_loss(name, old, new, adv, mask, mode="token-mean", **knobs):
    """The registered loss `name` on these (B, R) lists; (loss, clipfrac, ppo_kl, clipfrac_lower)
    as floats and d loss / d log_prob."""
    log_prob = torch.tensor(new, dtype=torch.float64, requires_grad=True)
    out = POLICY_LOSS_FNS[name](
        torch.tensor(old, dtype=torch.float64), log_prob, torch.tensor(adv, dtype=torch.float64),
        torch.tensor(mask, dtype=torch.float64), ActorUpdateConfig(**knobs), mode, None, None, None,
    )  # fmt: skip
    out[0].backward()
    return [float(x) for x in out], log_prob.grad


def assert_grad(grad: torch.Tensor, expected: list) -> None:
    torch.testing.assert_close(grad, torch.tensor(expected, dtype=torch.float64))


def test_cispo_weighs_log_pi_by_the_clipped_ratio_without_its_gradient():
    # ratios 1.5, 0.6, 1.0 against pi_old = 0.5; clip range [0.8, 1.28]
    old = [[log(0.5), log(0.5)], [log(0.5), 0.0]]
    new = [[log(0.75), log(0.3)], [log(0.5), 0.0]]
    adv, mask = [[1.0, -2.0], [0.5, 0.0]], [[1, 1], [1, 0]]
    (loss, clipfrac, ppo_kl, lower), grad = run_loss(
        "cispo", old, new, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.28
    )
    weights = (1.28, 0.8, 1.0)
    expected = (
        -(weights[0] * 1.0 * log(0.75) + weights[1] * -2.0 * log(0.3) + weights[2] * 0.5 * log(0.5)) / 3
    )
    assert loss == pytest.approx(expected)
    # the gradient w.r.t. log pi is -sg(w) * A / count: the ratio inside w contributes nothing
    assert_grad(grad, [[-1.28 * 1.0 / 3, 0.8 * 2.0 / 3], [-1.0 * 0.5 / 3, 0.0]])
    assert (clipfrac, lower) == pytest.approx((2 / 3, 0.0))
    assert ppo_kl == pytest.approx((log(0.5 / 0.75) + log(0.5 / 0.3) + 0.0) / 3)


def test_sapo_gates_the_advantage_softly_with_a_temperature_per_sign():
    old = [[log(0.5), log(0.5), log(0.4)]]
    new = [[log(0.75), log(0.3), log(0.4)]]  # ratios 1.5, 0.6, 1.0
    adv, mask = [[1.0, -2.0, 0.5]], [[1, 1, 1]]
    (loss, clipfrac, _, lower), grad = run_loss("sapo", old, new, adv, mask, tau_pos=1.0, tau_neg=1.05)

    def gate(r, tau):
        return sigmoid(tau * (r - 1)) * 4 / tau

    expected = -(gate(1.5, 1.0) * 1.0 + gate(0.6, 1.05) * -2.0 + gate(1.0, 1.0) * 0.5) / 3
    assert loss == pytest.approx(expected)
    # d/dlog pi of -f(r) A = -A f'(r) r with f'(r) = 4 s (1 - s), s = sigmoid(tau (r - 1));
    # on-policy (r = 1) f'(1) = 1: the plain policy gradient -A
    s0, s1 = sigmoid(0.5), sigmoid(1.05 * -0.4)
    assert_grad(grad, [[-4 * s0 * (1 - s0) * 1.5 / 3, 2.0 * 4 * s1 * (1 - s1) * 0.6 / 3, -0.5 / 3]])
    assert (clipfrac, lower) == (0.0, 0.0)


def test_gmpo_takes_the_geometric_mean_of_ratios_clipped_in_log_space():
    # sequence 0: A = +1, log-ratios 0.1, 0.5, -0.6; sequence 1: A = -1, log-ratios 0.5, -0.6, pad
    old = [[log(0.5)] * 3, [log(0.5)] * 3]
    log_ratios = [[0.1, 0.5, -0.6], [0.5, -0.6, 0.0]]
    new = [[log(0.5) + x for x in row] for row in log_ratios]
    adv, mask = [[1.0] * 3, [-1.0, -1.0, 0.0]], [[1, 1, 1], [1, 1, 0]]
    (loss, clipfrac, _, _), grad = run_loss(
        "gmpo", old, new, adv, mask, "seq-mean-token-mean", clip_ratio_low=0.4, clip_ratio_high=0.4
    )
    # A > 0 keeps min(x, clip(x)): 0.1, 0.4, -0.6; A < 0 keeps max(x, clip(x)): 0.5, -0.4
    ratio0, ratio1 = math.exp((0.1 + 0.4 - 0.6) / 3), math.exp((0.5 - 0.4) / 2)
    assert loss == pytest.approx((-1.0 * ratio0 + 1.0 * ratio1) / 2)
    assert clipfrac == pytest.approx(2 / 5)  # one clipped token in each sequence, of 5
    # d/dlog pi_t = -A * ratio / |o| / (2 sequences) where the clip is not active, else 0
    assert_grad(grad, [[-ratio0 / 3 / 2, 0.0, -ratio0 / 3 / 2], [ratio1 / 2 / 2, 0.0, 0.0]])


# (A, p_old, p) per token
DPPO_TOKENS = [(1.0, 0.5, 0.6), (1.0, 0.2, 0.4), (-1.0, 0.5, 0.3), (-1.0, 0.5, 0.45), (1.0, 0.01, 0.15)]


def dppo_run(name, threshold):
    adv = [[a for a, _, _ in DPPO_TOKENS]]
    old = [[log(p_old) for _, p_old, _ in DPPO_TOKENS]]
    new = [[log(p) for _, _, p in DPPO_TOKENS]]
    knobs = {"clip_ratio_low": threshold, "clip_ratio_high": threshold, "clip_ratio_c": 10.0}
    return run_loss(name, old, new, adv, [[1] * len(DPPO_TOKENS)], **knobs)


def test_dppo_tv_masks_tokens_whose_probability_moved_beyond_the_threshold():
    (loss, clipfrac, _, truncated), grad = dppo_run("dppo_tv", 0.15)
    # p - p_old: 0.1 in; 0.2 > 0.15 out (A > 0); -0.2 < -0.15 out (A < 0); -0.05 in; 0.14 in
    # with ratio 15 truncated to C = 10
    weights = [1.2, 0.0, 0.0, 0.9, 10.0]
    expected = -sum(w * a * log(p) for w, (a, _, p) in zip(weights, DPPO_TOKENS, strict=True)) / 5
    assert loss == pytest.approx(expected)
    assert_grad(grad, [[-w * a / 5 for w, (a, _, _) in zip(weights, DPPO_TOKENS, strict=True)]])
    assert (clipfrac, truncated) == pytest.approx((2 / 5, 1 / 5))


def test_dppo_kl_masks_tokens_whose_binary_kl_grew_beyond_the_threshold():
    def binary_kl(p_old, p):
        return p_old * log(p_old / p) + (1 - p_old) * log((1 - p_old) / (1 - p))

    # 0.5 -> 0.6: KL 0.020, in; 0.2 -> 0.4 (A > 0, rising): KL 0.092 > 0.05, out; 0.5 -> 0.3 (A < 0,
    # falling): KL 0.087, out; 0.5 -> 0.45: KL 0.005, in; 0.01 -> 0.15 (rising): KL 0.124, out
    kls = [binary_kl(p_old, p) for _, p_old, p in DPPO_TOKENS]
    assert [kl <= 0.05 for kl in kls] == [True, False, False, True, False]
    (loss, clipfrac, _, truncated), _ = dppo_run("dppo_kl", 0.05)
    weights = [1.2, 0.0, 0.0, 0.9, 0.0]
    expected = -sum(w * a * log(p) for w, (a, _, p) in zip(weights, DPPO_TOKENS, strict=True)) / 5
    assert loss == pytest.approx(expected)
    assert (clipfrac, truncated) == pytest.approx((3 / 5, 0.0))
    # a token moving against the trust region's direction stays in whatever its KL
    (loss, clipfrac, _, _), _ = run_loss(
        "dppo_kl", [[log(0.5)]], [[log(0.1)]], [[1.0]], [[1]], clip_ratio_low=0.05, clip_ratio_high=0.05
    )
    assert clipfrac == 0.0 and loss == pytest.approx(-0.2 * log(0.1))


# advantages and log pi whose covariance terms (A - mean A)(log pi - mean log pi) are 3, -3, 0, 0
COV_ADV, COV_NEW = [[3.0, 3.0], [-3.0, -3.0]], [[-1.0, -3.0], [-2.0, -2.0]]


def test_clip_cov_drops_the_loss_of_tokens_with_covariance_inside_the_bounds():
    knobs = {"clip_cov_ratio": 0.5, "clip_cov_lb": 1.0, "clip_cov_ub": 5.0}
    (loss, clipfrac, _, _), grad = run_loss("clip_cov", COV_NEW, COV_NEW, COV_ADV, [[1, 1], [1, 1]], **knobs)
    # r = 1: PPO's loss is -A; the one candidate (covariance 3 in (1, 5)) is dropped
    assert loss == pytest.approx((0.0 + -3.0 + 3.0 + 3.0) / 4)
    assert_grad(grad, [[0.0, -3.0 / 4], [3.0 / 4, 3.0 / 4]])
    assert clipfrac == pytest.approx(1 / 4)
    # a candidate PPO's clip already stops is not drawn: r = e^0.5 > 1.2 with A > 0
    old = [[-1.5, -3.0], [-2.0, -2.0]]
    (loss, clipfrac, _, _), _ = run_loss("clip_cov", old, COV_NEW, COV_ADV, [[1, 1], [1, 1]], **knobs)
    assert clipfrac == 0.0 and loss == pytest.approx((-3.0 * 1.2 - 3.0 + 3.0 + 3.0) / 4)


def test_kl_cov_penalises_the_tokens_of_largest_covariance():
    log_ratio = [[0.1, 0.2], [0.3, -0.1]]
    old = [[n - x for n, x in zip(nr, xr, strict=True)] for nr, xr in zip(COV_NEW, log_ratio, strict=True)]
    knobs = {"kl_cov_ratio": 0.25, "ppo_kl_coef": 0.5}  # one token of 4: covariance 3, the first
    (loss, clipfrac, _, _), grad = run_loss("kl_cov", old, COV_NEW, COV_ADV, [[1, 1], [1, 1]], **knobs)
    expected = (
        -3 * math.exp(0.1) + 0.5 * 0.1 - 3 * math.exp(0.2) + 3 * math.exp(0.3) + 3 * math.exp(-0.1)
    ) / 4
    assert loss == pytest.approx(expected)
    assert clipfrac == pytest.approx(1 / 4)
    # the penalty's gradient 0.5 * sign(log r) on the chosen token, -A r elsewhere: no clip
    assert grad[0, 0].item() == pytest.approx((-3 * math.exp(0.1) + 0.5) / 4)
    assert_grad(grad[1], [3 * math.exp(0.3) / 4, 3 * math.exp(-0.1) / 4])


@pytest.mark.parametrize("name", ["reinforce", "gpg"])
def test_reinforce_and_gpg_are_minus_advantage_times_log_pi(name):
    old = [[0.0, 0.0], [0.0, 0.0]]  # no ratio: pi_old does not enter the loss
    new = [[log(0.5), log(0.25)], [log(0.8), 0.0]]
    adv, mask = [[1.0, -2.0], [0.5, 7.0]], [[1, 1], [1, 0]]
    (loss, clipfrac, _, lower), grad = run_loss(name, old, new, adv, mask)
    assert loss == pytest.approx(-(1.0 * log(0.5) - 2.0 * log(0.25) + 0.5 * log(0.8)) / 3)
    assert_grad(grad, [[-1.0 / 3, 2.0 / 3], [-0.5 / 3, 0.0]])
    assert (clipfrac, lower) == (0.0, 0.0)


def test_dro_adds_the_squared_log_ratio_and_has_the_regularised_gradient():
    old, new = [[log(0.5), log(0.5)]], [[log(0.6), log(0.3)]]
    adv = [[1.0, -1.0]]
    (loss, *_), grad = run_loss("dro", old, new, adv, [[1, 1]], "seq-mean-token-sum", dro_beta=0.5)
    lr0, lr1 = log(0.6 / 0.5), log(0.3 / 0.5)
    assert loss == pytest.approx(-(log(0.6) - 0.25 * lr0**2) - (-log(0.3) - 0.25 * lr1**2))
    # -(A - beta log r) per token: the gradient of DRO's (A - beta log r)^2 / 2 in pi
    assert_grad(grad, [[-(1.0 - 0.5 * lr0), -(-1.0 - 0.5 * lr1)]])


def test_off_policy_weights_multiply_each_token_loss():
    log_prob = torch.tensor([[log(0.5), log(0.25)]])
    args = (torch.zeros(1, 2), log_prob, torch.tensor([[1.0, 1.0]]), torch.ones(1, 2), ActorUpdateConfig())
    loss, *_ = POLICY_LOSS_FNS["reinforce"](*args, "token-sum", None, None, torch.tensor([[2.0, 0.0]]))
    assert loss.item() == pytest.approx(-2.0 * log(0.5))


def test_token_sum_adds_every_valid_token_and_micro_batches_add_up():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert agg_loss(loss, mask, "token-sum").item() == 7.0
    assert sum(agg_loss(loss[i : i + 1], mask[i : i + 1], "token-sum").item() for i in range(2)) == 7.0


@pytest.mark.parametrize("name", ["vanilla", "gspo"])
def test_vanilla_and_gspo_entries_equal_their_functions_bit_for_bit(name):
    gen = torch.Generator().manual_seed(0)
    old, new = (torch.randn(3, 5, generator=gen) - 2 for _ in range(2))
    adv, mask = torch.randn(3, 5, generator=gen), (torch.rand(3, 5, generator=gen) > 0.3).float()
    weights = torch.rand(3, 5, generator=gen)
    cfg = ActorUpdateConfig(clip_ratio_low=0.1, clip_ratio_high=0.3, clip_ratio_c=2.5)
    entry_out = POLICY_LOSS_FNS[name](old, new, adv, mask, cfg, "seq-mean-token-mean", 11.0, 3.0, weights)
    if name == "vanilla":
        direct = compute_policy_loss(
            old, new, adv, mask, 0.1, 0.3, 2.5, "seq-mean-token-mean", 11.0, 3.0, weights
        )
    else:
        direct = compute_policy_loss_gspo(
            old, new, adv, mask, 0.1, 0.3, "seq-mean-token-mean", 11.0, 3.0, weights
        )
    assert all(torch.equal(a, b) for a, b in zip(entry_out, direct, strict=True))


def test_every_name_the_config_lists_is_registered_and_documented_and_vice_versa():
    hint = typing.get_type_hints(ActorUpdateConfig)["policy_loss"]
    (literal,) = [arg for arg in typing.get_args(hint) if typing.get_origin(arg) is typing.Literal]
    assert set(typing.get_args(literal)) == set(POLICY_LOSS_FNS)
    docs = (ROOT / "docs/algorithms.md").read_text()
    for name, fn in POLICY_LOSS_FNS.items():
        check_policy_loss_signature(fn, name)  # the common signature a user's loss must have too
        assert f"| `{name}` |" in docs, f"docs/algorithms.md's table of losses lacks {name}"


USER_LOSSES = """
import torch

from hybridflow.algorithms import POLICY_LOSS_FNS


def halved_reinforce(
    old_log_prob, log_prob, advantages, response_mask, config, loss_agg_mode, global_token_count,
    global_seq_count, is_weights=None,
):
    loss, clipfrac, ppo_kl, lower = POLICY_LOSS_FNS["reinforce"](
        old_log_prob, log_prob, advantages, response_mask, config, loss_agg_mode, global_token_count,
        global_seq_count, is_weights,
    )
    return 0.5 * loss, clipfrac, ppo_kl, lower


def wrong_signature(log_prob, advantages, mask):
    return -(advantages * log_prob).mean()
"""


@pytest.fixture
def user_losses(tmp_path, monkeypatch):
    (tmp_path / "user_losses.py").write_text(USER_LOSSES)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "user_losses"


def test_a_users_loss_loads_by_dotted_path_and_runs(user_losses):
    fn = policy_loss_fn(f"{user_losses}.halved_reinforce")
    log_prob = torch.tensor([[log(0.5)]])
    loss, *_ = fn(
        torch.zeros(1, 1),
        log_prob,
        torch.ones(1, 1),
        torch.ones(1, 1),
        ActorUpdateConfig(),
        "token-mean",
        None,
        None,
        None,
    )
    assert loss.item() == pytest.approx(-0.5 * log(0.5))


def test_a_users_loss_of_another_signature_is_refused_naming_key_function_and_parameters(user_losses):
    with pytest.raises(ValueError) as err:
        policy_loss_fn(f"{user_losses}.wrong_signature")
    message = str(err.value)
    assert "actor.update.policy_loss='user_losses.wrong_signature'" in message
    assert "wrong_signature takes ('log_prob', 'advantages', 'mask')" in message
    assert str(POLICY_LOSS_PARAMETERS) in message


def test_an_unknown_name_or_module_is_refused_naming_the_key():
    with pytest.raises(
        ValueError,
        match=r"actor.update.policy_loss='cispo2' is neither a registered loss.*did you mean 'cispo'",
    ):
        policy_loss_fn("cispo2")
    with pytest.raises(
        DottedPathError, match=r"actor.update.policy_loss='no_such_module.fn' cannot be imported"
    ):
        policy_loss_fn("no_such_module.fn")


class RayStarted(Exception):
    """Raised in place of connecting to Ray: the checks let the run through."""


@pytest.fixture(scope="module")
def tiny_recipe_args(tmp_path_factory) -> list[str]:
    """recipes/quickstart.yaml on a tiny model and arithmetic data, sized for 2 CPU processes."""
    from hybridflow.data.arith import ArithConfig, write_arith_parquet

    root = tmp_path_factory.mktemp("policy_loss_preflight")
    data = write_arith_parquet(root / "data", ArithConfig(num_train=8, num_test=4, seed=3))
    return [
        str(ROOT / "recipes/quickstart.yaml"),
        f"model.path={make_tiny_model(root / 'tiny')}",
        f"data.train_files=[{data['train']}]",
        f"data.val_files=[{data['test']}]",
        "data.train_batch_size=4",
        "rollout.sampling.n=2",
        "actor.update.ppo_mini_batch_size=8",
        "actor.update.ppo_micro_batch_size=4",
        "actor.log_prob_micro_batch_size=4",
        f"trainer.output_dir={root / 'out'}",
        "trainer.logger=[console]",
    ]


def run_entry_point(argv: list[str], monkeypatch, capsys) -> tuple[int, str]:
    """hybridflow.trainer.main with Ray refused (tests/test_bad_inputs.py's way): the exit status and
    stderr of a recipe the checks refuse; RayStarted for one they pass."""
    import ray

    def refuse(*args, **kwargs):
        raise RayStarted("the checks passed and the entry point went on to start Ray")

    monkeypatch.setattr(entry, "connect_ray", refuse)
    monkeypatch.setattr(ray, "init", refuse)
    code = entry.main(argv)
    return code, capsys.readouterr().err


@pytest.mark.usefixtures("in_quickstart_working_tree")
@pytest.mark.parametrize("loss", ["cispo", "user_losses.halved_reinforce"])
def test_a_registered_or_user_loss_passes_the_checks_before_ray(
    loss, user_losses, tiny_recipe_args, monkeypatch, capsys
):
    with pytest.raises(RayStarted):
        run_entry_point([*tiny_recipe_args, f"actor.update.policy_loss={loss}"], monkeypatch, capsys)


@pytest.mark.usefixtures("in_quickstart_working_tree")
def test_a_wrong_signature_is_refused_before_ray(user_losses, tiny_recipe_args, monkeypatch, capsys):
    argv = [*tiny_recipe_args, "actor.update.policy_loss=user_losses.wrong_signature"]
    code, err = run_entry_point(argv, monkeypatch, capsys)
    assert code == 2, err
    assert "Traceback" not in err
    assert "actor.update.policy_loss='user_losses.wrong_signature': wrong_signature takes" in err
    assert str(POLICY_LOSS_PARAMETERS) in err


@pytest.mark.usefixtures("in_quickstart_working_tree")
def test_dro_without_its_beta_is_refused_before_ray(tiny_recipe_args, monkeypatch, capsys):
    code, err = run_entry_point([*tiny_recipe_args, "actor.update.policy_loss=dro"], monkeypatch, capsys)
    assert code == 2 and "policy_loss=dro needs dro_beta > 0" in err, err


@pytest.mark.usefixtures("in_quickstart_working_tree")
@pytest.mark.parametrize(
    ("overrides", "warned"),
    [
        (["actor.update.tau_pos=2.0", "actor.update.dro_beta=0.1"], True),
        (["actor.update.policy_loss=sapo", "actor.update.tau_pos=2.0"], False),
    ],
    ids=["unread", "read"],
)
def test_a_knob_the_chosen_loss_does_not_read_is_warned_about(
    overrides, warned, tiny_recipe_args, monkeypatch, capsys, caplog
):
    with pytest.raises(RayStarted):
        run_entry_point([*tiny_recipe_args, *overrides], monkeypatch, capsys)
    warning = (
        "actor.update.tau_pos=2.0, actor.update.dro_beta=0.1 have no effect with "
        "actor.update.policy_loss=vanilla: docs/algorithms.md lists the losses that read them"
    )
    assert (warning in caplog.text) == warned, caplog.text
    assert ("has no effect with actor.update.policy_loss" in caplog.text) is False
