"""Preference objectives (DPO, IPO, SimPO, KTO) against hand-computed values and NumPy
re-derivations, DPO's gradient identity, empty rows, accumulation over micro-batches, and
their place in the registry (group_size, model terms, a chain of one transform)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlscale import objectives as obj
from rlscale.objectives import registry

# Two pairs: rows 0 (chosen) / 1 (rejected) and 2 (chosen) / 3 (rejected), of 3, 2, 1 and 4
# tokens. Per-token log-ratios logp - ref_logp, so the sequence log-ratios s_i are
# [1, -1, -0.5, 1] and the margins h = s_c - s_r are [2, -1.5].
MASK = np.array([[1, 1, 1, 0], [1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 1]], bool)
LOGP = np.array(
    [
        [-1.0, -0.5, -1.5, 0.0],
        [-2.0, -1.0, 0.0, 0.0],
        [-0.5, 0.0, 0.0, 0.0],
        [-1.0, -2.0, -1.0, -2.0],
    ]
)
DIFF = np.array(
    [
        [0.5, 0.25, 0.25, 0.0],
        [-0.5, -0.5, 0.0, 0.0],
        [-0.5, 0.0, 0.0, 0.0],
        [0.25, 0.25, 0.25, 0.25],
    ]
)
S = np.array([1.0, -1.0, -0.5, 1.0])
PAD = 7.0  # In padding: a loss that read it would be off.


def _terms(logp=LOGP, diff=DIFF, mask=MASK, **extra):
    logp = np.where(mask, logp, PAD)
    ref = np.where(mask, logp - diff, -PAD)
    return {
        "mask": jnp.asarray(mask),
        "logp": jnp.asarray(logp, jnp.float32),
        "ref_logp": jnp.asarray(ref, jnp.float32),
        **extra,
    }


def _run(transform, terms):
    out, _ = transform.update(terms, transform.init())
    return out


def _softplus(x):  # -log sigmoid(-x)
    return np.log1p(np.exp(x))


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def test_hand_values_are_the_fixture_log_ratios():
    np.testing.assert_allclose((DIFF * MASK).sum(1), S)


def test_dpo_hand_values_and_metrics():
    out = _run(obj.dpo(beta=0.5), _terms())
    # beta h = [1, -0.75]: -log sigmoid(1) + -log sigmoid(-0.75).
    expected = np.log1p(np.exp(-1.0)) + np.log1p(np.exp(0.75))
    assert float(out["loss_sum"]) == pytest.approx(expected, rel=1e-6)
    assert float(out["denominator"]) == 2.0
    m = out["metrics"]
    # Implicit rewards beta s: chosen [0.5, -0.25], rejected [-0.5, 0.5].
    assert float(m["implicit_reward_chosen"]) == pytest.approx(0.125)
    assert float(m["implicit_reward_rejected"]) == pytest.approx(0.0)
    assert float(m["implicit_reward_margin"]) == pytest.approx((1.0 - 0.75) / 2)
    assert float(m["implicit_reward_accuracy"]) == pytest.approx(0.5)


def test_dpo_label_smoothing_is_conservative_dpo():
    eps, beta = 0.2, 0.5
    out = _run(obj.dpo(beta=beta, label_smoothing=eps), _terms())
    z = beta * np.array([2.0, -1.5])
    expected = np.sum((1 - eps) * _softplus(-z) + eps * _softplus(z))
    assert float(out["loss_sum"]) == pytest.approx(expected, rel=1e-6)


def test_dpo_at_zero_margin_is_log_2():
    out = _run(obj.dpo(beta=0.1), _terms(diff=np.zeros_like(DIFF)))
    assert float(out["loss_sum"] / out["denominator"]) == pytest.approx(np.log(2.0), rel=1e-6)
    # Equal, nonzero log-ratios on both sides (exact in float32): still a zero margin.
    same = np.array([[0.5, 0.5, 0.5, 0], [0.75, 0.75, 0, 0], [1.0, 0, 0, 0], [0.25] * 4])
    out = _run(obj.dpo(beta=0.1), _terms(diff=same))
    assert float(out["loss_sum"] / out["denominator"]) == pytest.approx(np.log(2.0), rel=1e-6)
    assert float(out["metrics"]["implicit_reward_accuracy"]) == 0.0  # A zero margin is not > 0.


@pytest.mark.parametrize("eps", [0.0, 0.2])
def test_dpo_gradient_identity(eps):
    """d loss / d s_c = -beta ((1 - eps) sigmoid(-beta h) - eps sigmoid(beta h)) = -d / d s_r,
    and each token of the row gets that weight times its mask."""
    beta = 0.5
    t = _terms()

    def loss(logp):
        return _run(obj.dpo(beta=beta, label_smoothing=eps), {**t, "logp": logp})["loss_sum"]

    g = np.asarray(jax.grad(loss)(t["logp"]))
    h = np.array([2.0, -1.5])
    w = -beta * ((1 - eps) * _sigmoid(-beta * h) - eps * _sigmoid(beta * h))
    expected = np.stack([w[0], -w[0], w[1], -w[1]])[:, None] * MASK
    np.testing.assert_allclose(g, expected, rtol=1e-6, atol=1e-7)
    if eps == 0.0:  # The plain DPO weight, and no gradient through ref_logp.
        np.testing.assert_allclose(w, -beta * _sigmoid(-beta * h))
        g_ref = jax.grad(lambda r: _run(obj.dpo(beta=beta), {**t, "ref_logp": r})["loss_sum"])
        np.testing.assert_array_equal(g_ref(t["ref_logp"]), 0.0)


def test_dpo_matches_numpy_on_random_ragged_pairs():
    rng = np.random.default_rng(0)
    N, M = 10, 6
    mask = np.arange(M)[None] < rng.integers(1, M + 1, (N, 1))
    logp = -rng.uniform(0.1, 3.0, (N, M))
    diff = rng.normal(0.0, 0.5, (N, M))
    out = _run(obj.dpo(beta=0.3), _terms(logp, diff, mask))
    s = (diff * mask).sum(1)
    h = s[0::2] - s[1::2]
    assert float(out["loss_sum"]) == pytest.approx(np.sum(_softplus(-0.3 * h)), rel=1e-5)
    assert float(out["denominator"]) == N // 2


def test_ipo_hand_values_use_per_token_averages():
    out = _run(obj.ipo(tau=0.25), _terms())
    # Averaged log-ratios [1/3, -1/2, -1/2, 1/4]: margins [5/6, -3/4], target 1 / (2 tau) = 2.
    expected = (5 / 6 - 2) ** 2 + (-3 / 4 - 2) ** 2
    assert float(out["loss_sum"]) == pytest.approx(expected, rel=1e-6)
    assert float(out["denominator"]) == 2.0
    assert float(out["metrics"]["implicit_reward_margin"]) == pytest.approx((5 / 6 - 3 / 4) / 2)
    # (Summed log-ratios would give margins [2, -1.5] and loss 0 + 3.5^2 = 12.25.)


def test_ipo_minimum_is_at_margin_one_over_two_tau():
    tau = 0.25

    def terms_at(shift_P):
        # Adds shift_p to every token of pair p's chosen row: its average moves by shift_p.
        return _terms(diff=DIFF + (np.repeat(shift_P, 2) * [1, 0, 1, 0])[:, None])

    def loss(shift_P):
        return float(_run(obj.ipo(tau=tau), terms_at(shift_P))["loss_sum"])

    # Averaged margins [5/6, -3/4]: these shifts put both at 1 / (2 tau) = 2.
    at_min = 2.0 - np.array([5 / 6, -3 / 4])
    assert loss(at_min) == pytest.approx(0.0, abs=1e-10)
    for delta in (-0.1, 0.1):  # Each pair's loss is then delta^2.
        assert loss(at_min + delta) == pytest.approx(2 * delta**2, rel=1e-4)
    t = terms_at(at_min)
    g = jax.grad(lambda lp: _run(obj.ipo(tau=tau), {**t, "logp": lp})["loss_sum"])(t["logp"])
    np.testing.assert_allclose(g, 0.0, atol=1e-5)


def test_simpo_hand_values_and_no_reference():
    terms = _terms()
    del terms["ref_logp"]  # Reads no reference: runs without one.
    out = _run(obj.simpo(beta=2.0, gamma=0.5), terms)
    # Average logp [-1, -1.5, -0.5, -1.5] -> r = [-2, -3, -1, -3]; r_c - r_r - gamma = [.5, 1.5].
    expected = np.log1p(np.exp(-0.5)) + np.log1p(np.exp(-1.5))
    assert float(out["loss_sum"]) == pytest.approx(expected, rel=1e-6)
    assert float(out["denominator"]) == 2.0
    assert float(out["metrics"]["implicit_reward_margin"]) == pytest.approx(1.5)
    assert float(out["metrics"]["implicit_reward_accuracy"]) == 1.0
    assert registry.build("simpo", group_size=2, max_len=4).model_terms == {"logp"}


def test_simpo_gradient_is_length_normalized():
    beta, gamma = 2.0, 0.5
    t = _terms()
    g = jax.grad(lambda lp: _run(obj.simpo(beta, gamma), {**t, "logp": lp})["loss_sum"])(t["logp"])
    x = np.array([0.5, 1.5])  # r_c - r_r - gamma per pair
    w = -_sigmoid(-x)  # d loss / d (r_c - r_r)
    n = MASK.sum(1)
    per_row = np.array(
        [w[0] * beta / n[0], -w[0] * beta / n[1], w[1] * beta / n[2], -w[1] * beta / n[3]]
    )
    np.testing.assert_allclose(g, per_row[:, None] * MASK, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("w_d,w_u", [(1.0, 1.0), (1.0, 2.0)])
def test_kto_hand_values_labels_and_gradient(w_d, w_u):
    beta = 0.5
    correct = jnp.asarray([True, False, True, False])
    t = _terms(correct=correct)
    tx = obj.kto(beta=beta, desirable_weight=w_d, undesirable_weight=w_u)
    out = _run(tx, t)
    z0 = np.mean(S)  # 0.125 > 0: not clamped.
    desirable = w_d * (1 - _sigmoid(beta * (S - z0)))
    undesirable = w_u * (1 - _sigmoid(beta * (z0 - S)))
    rows = np.where([1, 0, 1, 0], desirable, undesirable)
    assert float(out["loss_sum"]) == pytest.approx(rows.sum(), rel=1e-6)
    assert float(out["denominator"]) == 4.0
    m = out["metrics"]
    assert float(m["kto_z0"]) == pytest.approx(0.125)
    assert float(m["kto_desirable_frac"]) == 0.5
    assert float(m["implicit_reward_desirable"]) == pytest.approx(beta * (1.0 - 0.5) / 2)
    assert float(m["implicit_reward_undesirable"]) == pytest.approx(beta * (-1.0 + 1.0) / 2)
    # Flipped labels: each row takes the other branch.
    flipped = _run(tx, {**t, "correct": ~correct})
    rows_flipped = np.where([0, 1, 0, 1], desirable, undesirable)
    assert float(flipped["loss_sum"]) == pytest.approx(rows_flipped.sum(), rel=1e-6)
    # z0 carries no gradient: each row's tokens get only d loss_i / d s_i times the mask.
    g = jax.grad(lambda lp: _run(tx, {**t, "logp": lp})["loss_sum"])(t["logp"])
    sd, su = _sigmoid(beta * (S - z0)), _sigmoid(beta * (z0 - S))
    dl_ds = np.where([1, 0, 1, 0], -w_d * beta * sd * (1 - sd), w_u * beta * su * (1 - su))
    np.testing.assert_allclose(g, dl_ds[:, None] * MASK, rtol=1e-5, atol=1e-7)


def test_kto_reference_point_is_clamped_at_zero_and_any_group_size():
    beta = 0.5
    # s = [-1, 1, 0.5, -1]: mean -0.125, so z0 = 0.
    t = _terms(diff=-DIFF, correct=jnp.asarray([True, True, False, False]))
    out = _run(obj.kto(beta=beta), t)
    s = -S
    expected = np.sum(1 - _sigmoid(beta * s[:2])) + np.sum(1 - _sigmoid(-beta * s[2:]))
    assert float(out["metrics"]["kto_z0"]) == 0.0
    assert float(out["loss_sum"]) == pytest.approx(expected, rel=1e-6)
    assert registry.check("kto", group_size=4, max_len=4) == []
    assert registry.check("kto", group_size=1, max_len=4) == []


PAIRED = {
    "dpo": lambda: obj.dpo(beta=0.5, label_smoothing=0.1),
    "ipo": lambda: obj.ipo(tau=0.25),
    "simpo": lambda: obj.simpo(),
}
ALL = {**PAIRED, "kto": lambda: obj.kto(beta=0.5)}


@pytest.mark.parametrize("name", list(ALL))
def test_rows_without_tokens_add_nothing_and_no_nan(name):
    tx = ALL[name]()
    # A third pair whose rejected row is empty (a dropped prompt, or an empty completion),
    # and a fourth with both rows empty; padding holds NaN.
    mask = np.concatenate([MASK, [[1, 1, 0, 0], [0] * 4, [0] * 4, [0] * 4]]).astype(bool)
    logp = np.concatenate([LOGP, np.full((4, 4), -1.0)])
    diff = np.concatenate([DIFF, np.full((4, 4), 0.3)])
    correct = jnp.asarray([True, False, True, False, True, False, True, False])
    t = _terms(logp, diff, mask, correct=correct)
    t["logp"] = jnp.where(t["mask"], t["logp"], jnp.nan)
    t["ref_logp"] = jnp.where(t["mask"], t["ref_logp"], jnp.nan)
    base = _run(tx, _terms(correct=correct[:4]))
    out = _run(tx, t)
    if name == "kto":  # Row 4 is a row of its own (s = 0.6); rows 5 to 7 count nowhere.
        s = np.append(S, 0.6)
        z0 = s.mean()
        u = 1 - _sigmoid(0.5 * (s - z0)), 1 - _sigmoid(0.5 * (z0 - s))
        expected = np.where([1, 0, 1, 0, 1], u[0], u[1]).sum()
        assert float(out["denominator"]) == 5.0
        assert float(out["loss_sum"]) == pytest.approx(expected, rel=1e-6)
    else:  # Pair 2 lacks a side and pair 3 both: they count nowhere.
        assert float(out["denominator"]) == 2.0
        assert float(out["loss_sum"]) == pytest.approx(float(base["loss_sum"]), rel=1e-6)
        for k, v in base["metrics"].items():
            assert float(out["metrics"][k]) == pytest.approx(float(v), rel=1e-6, abs=1e-7), k
    g = jax.grad(lambda lp: _run(tx, {**t, "logp": lp})["loss_sum"])(t["logp"])
    assert np.all(np.isfinite(g))
    np.testing.assert_array_equal(g[~mask], 0.0)
    if name != "kto":
        np.testing.assert_array_equal(g[4:], 0.0)
    # No rows with tokens at all: zero loss, zero denominator, finite metrics.
    empty = _run(tx, {**t, "mask": jnp.zeros_like(t["mask"])})
    assert float(empty["loss_sum"]) == 0.0 and float(empty["denominator"]) == 0.0
    assert all(np.isfinite(float(v)) for v in empty["metrics"].values())


@pytest.mark.parametrize("name", list(PAIRED))
def test_accumulation_over_micro_batches_of_whole_pairs(name):
    """sum(loss_sum) / sum(denominator) and its gradient are the same for 1, 2 or 4
    micro-batches, sliced (a plain loop over rows) or with the other rows' mask zeroed (the
    learner's packed micro-batches)."""
    tx = PAIRED[name]()
    rng = np.random.default_rng(1)
    N, M = 8, 5
    mask = np.arange(M)[None] < rng.integers(1, M + 1, (N, 1))
    mask[5] = False  # Pair 2 has no rejected tokens.
    t = _terms(-rng.uniform(0.1, 3.0, (N, M)), rng.normal(0.0, 0.4, (N, M)), mask)

    def sums(logp, rows, packed):
        if packed:
            keep = np.isin(np.arange(N), rows)[:, None]
            terms = {**t, "logp": logp, "mask": t["mask"] & keep}
        else:
            terms = {k: v[rows] for k, v in {**t, "logp": logp}.items()}
        out = _run(tx, terms)
        return out["loss_sum"], out["denominator"]

    full_loss, full_denom = sums(t["logp"], np.arange(N), packed=False)
    full_grad = jax.grad(lambda lp: sums(lp, np.arange(N), False)[0])(t["logp"]) / full_denom
    assert float(full_denom) == 3.0
    for n_micro in (2, 4):
        for packed in (False, True):
            loss, denom, grad = 0.0, 0.0, 0.0
            for rows in np.split(np.arange(N), n_micro):
                micro_loss, d = sums(t["logp"], rows, packed)
                g = jax.grad(lambda lp, r=rows, p=packed: sums(lp, r, p)[0])(t["logp"])
                loss, denom, grad = loss + micro_loss, denom + d, grad + g
            assert float(denom) == float(full_denom)
            assert float(loss / denom) == pytest.approx(float(full_loss / full_denom), rel=1e-6)
            np.testing.assert_allclose(grad / denom, full_grad, rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("name", list(PAIRED))
def test_paired_losses_need_groups_of_two(name):
    message = (
        f"objective.chain: {name}: group_size=4: preference pairs are groups of 2 rows (row 2p "
        "chosen, row 2p + 1 rejected); set batch.group_size = 2"
    )
    assert registry.check(name, group_size=4, max_len=4) == [message]
    with pytest.raises(ValueError, match=r"group_size=1: preference pairs"):
        registry.build(name, group_size=1, max_len=4)
    with pytest.raises(ValueError, match=rf"^{name}: 3 rows are not whole preference pairs"):
        _run(PAIRED[name](), {k: v[:3] for k, v in _terms().items()})


@pytest.mark.parametrize(
    "spec,message",
    [
        ("dpo(beta=0)", "dpo: beta=0 must be > 0"),
        ("dpo(label_smoothing=0.5)", "dpo: label_smoothing=0.5 must be in [0, 0.5)"),
        ("ipo(tau=-1)", "ipo: tau=-1 must be > 0"),
        ("simpo(beta=0.0)", "simpo: beta=0.0 must be > 0"),
        ("kto(undesirable_weight=-1.0)", "kto: undesirable_weight=-1.0 must be >= 0"),
        ("dpo(tau=0.1)", "dpo has no argument 'tau' (its arguments: beta, label_smoothing)"),
    ],
)
def test_bad_arguments_name_the_problem(spec, message):
    assert registry.check(spec, group_size=2, max_len=4) == [f"objective.chain: {message}"]


@pytest.mark.parametrize(
    "spec,model_terms",
    [
        ("dpo(beta=0.1)", {"logp", "ref_logp"}),
        ("ipo", {"logp", "ref_logp"}),
        ("simpo(beta=2.5, gamma=1.0)", {"logp"}),
        ("kto(desirable_weight=1.33)", {"logp", "ref_logp"}),
    ],
)
def test_a_preference_loss_is_a_whole_chain(spec, model_terms):
    """It ends the loss stage itself (it provides loss_sum and denominator), and runs on the
    run's terms plus exactly its model terms."""
    assert registry.check(spec, group_size=2, max_len=4) == []
    objective = registry.build(spec, group_size=2, max_len=4)
    assert objective.model_terms == model_terms
    run = {
        "reward": jnp.asarray([1.0, 0.0, 0.0, 1.0]),
        "correct": jnp.asarray([True, False, False, True]),
        "mask": jnp.asarray(MASK),
        "row_weight": jnp.ones(4),
        "sampler_logp": jnp.asarray(LOGP, jnp.float32),
    }
    model = {"logp": jnp.asarray(LOGP, jnp.float32), "ref_logp": jnp.asarray(LOGP - DIFF)}
    out, _ = objective.loss.update(
        {**run, **{k: model[k] for k in model_terms}, "update": jnp.asarray(0, jnp.int32)},
        objective.loss.init(),
    )
    assert np.isfinite(float(out["loss_sum"])) and float(out["denominator"]) > 0


def test_registered_with_their_factories():
    names = ("dpo", "ipo", "simpo", "kto")
    assert set(names) <= set(registry.names())
    for e in registry.entries():
        if e.name in names:
            assert getattr(obj, e.name) is e.factory
            assert e.stage == "loss" and e.provides == registry.AGGREGATION_TERMS
