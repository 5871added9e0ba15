"""Objective transforms against hand-computed values, gradients and accumulation invariances;
the registry's chain strings (parse, check, build) and every config's chain."""

import importlib.util
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlscale import config_lib
from rlscale import objectives as obj
from rlscale.objectives import registry

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Two prompts x two samples, ragged completions of 4, 2, 3 and 1 tokens.
MASK = np.array([[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 0]], bool)
REWARD = np.array([1.0, 0.0, 1.0, 1.0])


def _terms(**extra):
    rng = np.random.default_rng(0)
    logp = -rng.uniform(0.1, 2.0, MASK.shape)
    return {
        "mask": jnp.asarray(MASK),
        "reward": jnp.asarray(REWARD),
        "logp": jnp.asarray(logp, jnp.float32),
        # The trainer's recomputation and the generator's logprobs differ, as after policy lag.
        "old_logp": jnp.asarray(logp + rng.normal(0, 0.3, MASK.shape), jnp.float32),
        "sampler_logp": jnp.asarray(logp + rng.normal(0, 0.3, MASK.shape), jnp.float32),
        **extra,
    }


def _run(transform, terms):
    out, _ = transform.update(terms, transform.init())
    return out


@pytest.mark.parametrize(
    "baseline,scale,expected",
    [
        ("group_mean", "group_std", [2**-0.5, -(2**-0.5), 0.0, 0.0]),
        ("rloo", "none", [1.0, -1.0, 0.0, 0.0]),
        ("group_mean", "none", [0.5, -0.5, 0.0, 0.0]),
        # Centred rewards [.5, -.5, 0, 0] have batch std sqrt(0.5 / 3).
        ("group_mean", "batch_std", [0.5 / (1 / 6) ** 0.5, -0.5 / (1 / 6) ** 0.5, 0.0, 0.0]),
    ],
)
def test_group_advantages_hand_values(baseline, scale, expected):
    out = _run(
        obj.group_advantages(2, baseline, scale, eps=0.0 if scale == "none" else 1e-6), _terms()
    )
    np.testing.assert_allclose(out["advantage"][:, 0], expected, rtol=1e-5, atol=1e-6)
    assert out["advantage"].shape == MASK.shape


def test_batch_std_ignores_dropped_rows():
    terms = _terms(row_weight=jnp.asarray([1.0, 1.0, 0.0, 0.0]))
    out = _run(obj.group_advantages(2, "group_mean", "batch_std", eps=0.0), terms)
    # Over the two kept rows [.5, -.5]: std (ddof 1) = sqrt(0.5).
    np.testing.assert_allclose(
        out["advantage"][:2, 0], [0.5 / 0.5**0.5, -0.5 / 0.5**0.5], rtol=1e-5
    )


@pytest.mark.parametrize("behaviour,term", [("generator", "sampler_logp"), ("trainer", "old_logp")])
def test_ratios(behaviour, term):
    t = _terms()
    other = {"generator": "old_logp", "trainer": "sampler_logp"}[behaviour]
    t_read = {k: v for k, v in t.items() if k != other}  # Reads only its behaviour's term.
    out = _run(obj.token_ratio(behaviour=behaviour), t_read)
    np.testing.assert_allclose(out["ratio"], np.exp(t["logp"] - t[term]), rtol=1e-6)
    seq = _run(obj.sequence_ratio(behaviour=behaviour), t_read)["ratio"]
    d = np.asarray((t["logp"] - t[term]) * MASK)
    expected = np.exp(d.sum(1) / MASK.sum(1))
    np.testing.assert_allclose(seq[:, 0], expected, rtol=1e-6)
    np.testing.assert_allclose(seq[:, -1], expected, rtol=1e-6)


# logp, the generator's logprobs and the trainer's recomputation all differ: a ratio against
# the wrong behaviour policy gets other values.
ONE_ROW = {
    "mask": jnp.asarray([[1, 1, 0]], bool),
    "logp": jnp.asarray([[-1.0, -2.0, -3.0]]),
    "sampler_logp": jnp.asarray([[-1.5, -1.0, -9.0]]),
    "old_logp": jnp.asarray([[-0.5, -2.5, -1.0]]),
}


def test_ratios_hand_values_generator_by_default():
    tok = _run(obj.token_ratio(), ONE_ROW)["ratio"][0, :2]
    np.testing.assert_allclose(tok, [np.exp(0.5), np.exp(-1.0)], rtol=1e-6)
    tok = _run(obj.token_ratio(behaviour="trainer"), ONE_ROW)["ratio"][0, :2]
    np.testing.assert_allclose(tok, [np.exp(-0.5), np.exp(0.5)], rtol=1e-6)
    # Geometric mean over the two real tokens: exp((0.5 - 1) / 2); the trainer's: exp(0).
    seq = _run(obj.sequence_ratio(), ONE_ROW)["ratio"][0]
    np.testing.assert_allclose(seq, [np.exp(-0.25)] * 3, rtol=1e-6)
    seq = _run(obj.sequence_ratio(behaviour="trainer"), ONE_ROW)["ratio"][0]
    np.testing.assert_allclose(seq, [1.0] * 3, rtol=1e-6)


def test_scalerl_cispo_weight_is_against_the_generator():
    """ScaleRL's CISPO: d loss / d logp_t = -sg(min(pi / pi_gen, eps_max)) A_t / #tokens."""
    tx = obj.chain(obj.token_ratio(), obj.cispo(eps_max=1.5), obj.aggregate("token_mean"))
    adv = jnp.asarray([[1.0, 2.0, 5.0]])

    def loss(logp):
        out = _run(tx, {**ONE_ROW, "logp": logp, "advantage": adv})
        return out["loss_sum"] / out["denominator"]

    g = jax.grad(loss)(ONE_ROW["logp"])[0]
    # Ratios e^0.5 = 1.65 (capped at 1.5) and e^-1 (against old_logp: e^-0.5 and 1.5).
    np.testing.assert_allclose(g, [-1.5 * 1 / 2, -np.exp(-1.0) * 2 / 2, 0.0], rtol=1e-6)


def test_ppo_clip_hand_values():
    ratio = jnp.asarray([[1.5, 0.5, 1.1, 0.7]] * 4)
    adv = jnp.asarray([[1.0, 1.0, -1.0, -1.0]] * 4)
    terms = {"ratio": ratio, "advantage": adv, "mask": jnp.asarray(MASK)}
    loss = _run(obj.ppo_clip(0.2, 0.28), terms)["loss"][0]
    # A>0: -min(r, 1.28); A<0: -min(-r, -clip(r, .8, 1.28)) = max(r, clip(r)).
    np.testing.assert_allclose(loss, [-1.28, -0.5, 1.1, 0.8], rtol=1e-6)
    ratio3 = jnp.asarray([[5.0, 1.0, 1.0, 1.0]] * 4)
    adv3 = jnp.asarray([[-1.0, 1.0, 1.0, 1.0]] * 4)
    dual = _run(
        obj.ppo_clip(0.2, 0.2, dual_clip=3.0),
        {"ratio": ratio3, "advantage": adv3, "mask": jnp.asarray(MASK)},
    )["loss"]
    assert float(dual[0, 0]) == pytest.approx(3.0)  # min(5, 3): the dual clip.


def test_cispo_gradient_is_detached_weight_times_advantage():
    t = _run(obj.chain(obj.group_advantages(2, "group_mean", "none"), obj.token_ratio()), _terms())

    def loss(logp, form):
        terms = {**t, "logp": logp, "ratio": jnp.exp(logp - t["sampler_logp"])}
        out = _run(obj.chain(form, obj.aggregate("token_mean")), terms)
        return out["loss_sum"]

    for form, weight in [
        (obj.cispo(eps_max=1.1), lambda r: np.minimum(r, 1.1)),
        (obj.cispo(eps_max=None, eps_low=0.1, eps_high=0.2), lambda r: np.clip(r, 0.9, 1.2)),
    ]:
        g = jax.grad(loss)(t["logp"], form)
        r = np.exp(np.asarray(t["logp"] - t["sampler_logp"]))
        expected = -weight(r) * np.asarray(t["advantage"]) * MASK
        np.testing.assert_allclose(g, expected, rtol=1e-5, atol=1e-7)


def _policy(theta, tokens):
    """A toy policy: logp of `tokens` under per-position softmax(theta)."""
    logp = jax.nn.log_softmax(theta, axis=-1)
    return jnp.take_along_axis(logp, tokens[..., None], axis=-1)[..., 0]


def _toy(n_rows=4, seed=0):
    rng = np.random.default_rng(seed)
    theta = jnp.asarray(rng.normal(size=(n_rows, 4, 5)), jnp.float32)
    tokens = jnp.asarray(rng.integers(0, 5, (n_rows, 4)))
    return theta, tokens


def test_clipped_objectives_equal_plain_policy_gradient_on_policy():
    theta, tokens = _toy()
    base = obj.group_advantages(2, "group_mean", "group_std")
    sampler_logp = jax.lax.stop_gradient(_policy(theta, tokens))  # Sampled by this policy.

    def grad(transform, agg="seq_mean_token_mean"):
        def loss(theta):
            terms = {
                "mask": jnp.asarray(MASK),
                "reward": jnp.asarray(REWARD),
                "logp": _policy(theta, tokens),
                "sampler_logp": sampler_logp,
            }
            out = _run(obj.chain(base, transform, obj.aggregate(agg)), terms)
            return out["loss_sum"] / out["denominator"]

        return jax.grad(loss)(theta)

    plain = grad(obj.policy_gradient())
    for transform in (
        obj.chain(obj.token_ratio(), obj.ppo_clip(0.2, 0.28)),
        obj.chain(obj.token_ratio(), obj.ppo_clip(0.2, 0.2, dual_clip=3.0)),
        obj.chain(obj.token_ratio(), obj.cispo(eps_max=4.0)),
        obj.chain(obj.sequence_ratio(), obj.ppo_clip(3e-4, 4e-4)),
    ):
        np.testing.assert_allclose(grad(transform), plain, rtol=1e-5, atol=1e-7)
    assert np.abs(plain).max() > 0.01


def test_chain_equals_sequential_application():
    a = obj.group_advantages(2, "rloo", "none")
    b = obj.chain(obj.token_ratio(), obj.ppo_clip())
    t = _terms()
    chained = _run(obj.chain(a, b), t)
    sequential = _run(b, _run(a, t))
    for k in ("advantage", "ratio", "loss"):
        np.testing.assert_array_equal(chained[k], sequential[k])


def test_token_mean_vs_prompt_mean_on_ragged_lengths():
    loss = jnp.asarray(np.arange(16, dtype=np.float32).reshape(4, 4))
    terms = {"loss": loss, "mask": jnp.asarray(MASK)}
    tm = _run(obj.aggregate("token_mean"), terms)
    pm = _run(obj.aggregate("prompt_mean", group_size=2), terms)
    sm = _run(obj.aggregate("seq_mean_token_mean"), terms)
    ss = _run(obj.aggregate("seq_sum", max_len=8), terms)
    # Real tokens: row0 0+1+2+3=6, row1 4+5=9, row2 8+9+10=27, row3 12.
    assert float(tm["loss_sum"] / tm["denominator"]) == pytest.approx(54 / 10)
    assert float(pm["loss_sum"] / pm["denominator"]) == pytest.approx((15 / 6 + 39 / 4) / 2)
    assert float(sm["loss_sum"] / sm["denominator"]) == pytest.approx(
        (6 / 4 + 9 / 2 + 27 / 3 + 12 / 1) / 4
    )
    assert float(ss["loss_sum"] / ss["denominator"]) == pytest.approx(54 / (4 * 8))
    # Prompt 1's short completions weigh more per token under prompt_mean than token_mean.
    assert float(pm["loss_sum"] / pm["denominator"]) > float(tm["loss_sum"] / tm["denominator"])


@pytest.mark.slow
@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean", "seq_sum", "prompt_mean"])
def test_accumulation_over_micro_batches_gives_the_same_gradient(agg):
    theta, tokens = _toy(n_rows=8, seed=1)
    rng = np.random.default_rng(2)
    mask = jnp.asarray(np.arange(4)[None] < rng.integers(1, 5, (8, 1)))
    reward = jnp.asarray(rng.integers(0, 2, 8).astype(np.float32))
    sampler_logp = jax.lax.stop_gradient(_policy(theta, tokens)) + 0.05
    chain = obj.chain(
        obj.group_advantages(2, "group_mean", "batch_std"),
        obj.token_ratio(),
        obj.cispo(eps_max=1.02),
        obj.aggregate(agg, group_size=2, max_len=4),
    )
    # Advantages use batch statistics: compute them once on the full batch, as the loop does.
    terms = {"mask": mask, "reward": reward, "logp": sampler_logp, "sampler_logp": sampler_logp}
    adv = _run(chain, terms)["advantage"]
    loss_chain = obj.chain(
        obj.token_ratio(), obj.cispo(eps_max=1.02), obj.aggregate(agg, group_size=2, max_len=4)
    )

    def sums(theta, rows):
        terms = {
            "mask": mask[rows],
            "advantage": adv[rows],
            "sampler_logp": sampler_logp[rows],
            "logp": _policy(theta[rows], tokens[rows]),
        }
        out = _run(loss_chain, terms)
        return out["loss_sum"], out["denominator"]

    grads = {}
    for n_micro in (1, 2, 4):
        total_grad, total_denom = 0.0, 0.0
        for rows in np.split(np.arange(8), n_micro):
            g, d = jax.grad(lambda t, rows=rows: sums(t, rows)[0])(theta), sums(theta, rows)[1]
            total_grad, total_denom = total_grad + g, total_denom + d
        grads[n_micro] = total_grad / total_denom
    np.testing.assert_allclose(grads[2], grads[1], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(grads[4], grads[1], rtol=1e-5, atol=1e-7)


def test_kl_estimators_and_kl_in_reward():
    logp = jnp.asarray([[-1.0, -2.0]])
    ref = jnp.asarray([[-1.5, -1.0]])
    d = np.array([0.5, -1.0])  # logp - ref
    np.testing.assert_allclose(obj.kl_estimate(logp, ref, "k1")[0], d)
    np.testing.assert_allclose(obj.kl_estimate(logp, ref, "k2")[0], d**2 / 2)
    np.testing.assert_allclose(obj.kl_estimate(logp, ref, "k3")[0], np.exp(-d) - 1 + d, rtol=1e-6)
    terms = {
        "old_logp": logp,
        "ref_logp": ref,
        "mask": jnp.ones((1, 2), bool),
        "reward": jnp.asarray([1.0]),
        "update": jnp.asarray(0, jnp.int32),
    }
    out = _run(obj.kl_in_reward(0.1, "k1"), terms)
    assert float(out["reward"][0]) == pytest.approx(1.0 - 0.1 * (0.5 - 1.0))
    # The configured estimator, not k1: k3 = e^-d - 1 + d = 0.10653 and 0.71828, summed 0.82481.
    out = _run(obj.kl_in_reward(0.1, "k3"), terms)
    assert float(out["reward"][0]) == pytest.approx(1.0 - 0.1 * 0.824812, rel=1e-5)
    out = _run(obj.kl_penalty(lambda update: 0.5, "k2"), {**terms, "logp": logp})
    np.testing.assert_allclose(out["loss"][0], 0.5 * d**2 / 2, rtol=1e-6)


def test_truncated_is_token_and_sequence():
    terms = {
        "loss": jnp.ones((1, 3)),
        "mask": jnp.asarray([[1, 1, 0]], bool),
        "old_logp": jnp.asarray([[-1.0, -1.0, -1.0]]),
        "sampler_logp": jnp.asarray([[-2.0, -0.5, -9.0]]),
    }
    tok = _run(obj.truncated_is(cap=2.0, level="token"), terms)["loss"][0]
    np.testing.assert_allclose(tok[:2], [2.0, np.exp(-0.5)], rtol=1e-6)  # e^1 capped at 2.
    seq = _run(obj.truncated_is(cap=5.0, level="sequence"), terms)["loss"][0]
    np.testing.assert_allclose(seq[:2], [np.exp(0.5)] * 2, rtol=1e-6)


def test_gae_matches_numpy_and_value_loss_clips():
    mask = np.array([[1, 1, 1, 0]], bool)
    old_value = np.array([[0.2, 0.5, 0.4, 9.0]], np.float32)
    terms = {
        "mask": jnp.asarray(mask),
        "reward": jnp.asarray([1.0]),
        "old_value": jnp.asarray(old_value),
    }
    out = _run(obj.gae(gamma=0.9, lam=0.8), terms)
    v = old_value[0, :3]
    rewards = np.array([0.0, 0.0, 1.0])
    v_next = np.array([0.5, 0.4, 0.0])
    delta = rewards + 0.9 * v_next - v
    adv = np.zeros(3)
    running = 0.0
    for t in reversed(range(3)):
        running = delta[t] + 0.9 * 0.8 * running
        adv[t] = running
    np.testing.assert_allclose(out["advantage"][0, :3], adv, rtol=1e-5)
    assert float(out["advantage"][0, 3]) == 0.0
    out = {**out, "value": jnp.asarray([[1.0, 0.5, 0.4, 0.0]])}
    vl = _run(obj.value_loss(coef=1.0, clip_eps=0.1), out)["loss"][0, 0]
    ret = adv[0] + 0.2
    expected = 0.5 * max((1.0 - ret) ** 2, (0.3 - ret) ** 2)
    assert float(vl) == pytest.approx(expected, rel=1e-5)


def test_bad_arguments_name_the_problem():
    with pytest.raises(ValueError, match="baseline='median'"):
        obj.group_advantages(2, baseline="median")
    with pytest.raises(ValueError, match="aggregation 'mean'"):
        obj.aggregate("mean")
    with pytest.raises(ValueError, match="needs group_size"):
        obj.aggregate("prompt_mean")
    with pytest.raises(ValueError, match="cispo: pass eps_max alone"):
        obj.cispo(eps_max=4.0, eps_low=0.2, eps_high=0.2)
    with pytest.raises(ValueError, match=r"^behaviour='sampler' is not one of \('generator', "):
        obj.sequence_ratio(behaviour="sampler")
    with pytest.raises(KeyError, match=r"ppo_clip needs term\(s\) \['ratio'\]"):
        _run(obj.ppo_clip(), {"advantage": 1.0, "mask": jnp.ones((1, 1))})
    with pytest.raises(ValueError, match="5 rows are not whole groups of 2"):
        _run(obj.group_advantages(2), {"reward": jnp.ones(5), "mask": jnp.ones((5, 1))})


# ---- fixes --------------------------------------------------------------------------------
# A completion whose tokens 3 and 4 were written by forced interruption: holes in its mask.
HOLES = np.array([[1, 1, 1, 0, 0, 1, 1, 1]], bool)


def _gae(mask, old_value, reward, gamma, lam):
    terms = {
        "mask": jnp.asarray(mask),
        "reward": jnp.asarray(reward, jnp.float32),
        "old_value": jnp.asarray(old_value, jnp.float32),
    }
    return _run(obj.gae(gamma=gamma, lam=lam), terms)


def test_gae_skips_holes_in_the_mask():
    # gamma = lambda = 1, V = 0, reward 1 at the last unmasked token: every action gets 1.
    out = _gae(HOLES, np.zeros((1, 8)), [1.0], gamma=1.0, lam=1.0)
    np.testing.assert_array_equal(out["advantage"][0], [1, 1, 1, 0, 0, 1, 1, 1])
    # gamma = 0.5: each unmasked step back halves it, the holes are not steps (index 2 gets
    # 0.5^3 from index 5), and values at holes (100) are ignored.
    value = np.array([[0, 0, 0, 100, 100, 0, 0, 0]])
    out = _gae(HOLES, value, [1.0], gamma=0.5, lam=1.0)
    np.testing.assert_allclose(
        out["advantage"][0], [1 / 32, 1 / 16, 1 / 8, 0, 0, 1 / 4, 1 / 2, 1], rtol=1e-6
    )


def test_gae_with_values_across_holes_hand_values():
    # Unmasked V = .2 .5 .4 | .1 .3 .6, gamma 1, lambda 0.5, reward 1 at index 7:
    # deltas (r + V_next - V): 7: 1 - .6 = .4; 6: .6 - .3 = .3; 5: .3 - .1 = .2;
    # 2: .1 - .4 = -.3 (next unmasked is 5); 1: .4 - .5 = -.1; 0: .5 - .2 = .3.
    # A_t = delta_t + .5 A_next: .4, .5, .45, -.075, -.1375, .23125.
    value = np.array([[0.2, 0.5, 0.4, 7.0, -7.0, 0.1, 0.3, 0.6]])
    out = _gae(HOLES, value, [1.0], gamma=1.0, lam=0.5)
    expected = np.array([0.23125, -0.1375, -0.075, 0, 0, 0.45, 0.5, 0.4])
    np.testing.assert_allclose(out["advantage"][0], expected, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(
        out["returns"][0], expected + value[0] * HOLES[0], rtol=1e-5, atol=1e-7
    )


def test_gae_with_holes_matches_numpy():
    rng = np.random.default_rng(3)
    mask = rng.random((6, 9)) < 0.7
    mask[0] = False  # A row without tokens.
    value = rng.normal(size=mask.shape)
    reward = rng.normal(size=6)
    out = _gae(mask, value, reward, gamma=0.9, lam=0.8)
    expected = np.zeros(mask.shape)
    for i in range(6):
        steps = np.flatnonzero(mask[i])  # The actions, in order; holes are not steps.
        adv_next = v_next = 0.0
        for j, t in enumerate(steps[::-1]):
            r = reward[i] if j == 0 else 0.0
            adv_next = r + 0.9 * v_next - value[i, t] + 0.9 * 0.8 * adv_next
            v_next = value[i, t]
            expected[i, t] = adv_next
    np.testing.assert_allclose(out["advantage"], expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("transform", ["kl_penalty", "entropy_bonus"])
def test_schedules_follow_the_update_term_not_calls(transform):
    t = {
        "logp": jnp.asarray([[-1.0, -2.0]]),
        "ref_logp": jnp.asarray([[-1.5, -1.0]]),
        "entropy": jnp.asarray([[0.5, 1.0]]),
        "mask": jnp.ones((1, 2), bool),
    }
    tx = getattr(obj, transform)(lambda update: 0.1 * update)
    assert tx.init() == obj.EmptyState()
    # Two micro-batches of update 3, then update 4: the coefficient is 0.3, 0.3, 0.4.
    state = tx.init()
    coefs = []
    for update in (3, 3, 4):
        out, state = tx.update({**t, "update": jnp.asarray(update, jnp.int32)}, state)
        coefs.append(float(out["metrics"]["kl_coef"]) if transform == "kl_penalty" else None)
        per_unit = np.asarray(
            obj.kl_estimate(t["logp"], t["ref_logp"], "k3")
            if transform == "kl_penalty"
            else -t["entropy"]
        )
        np.testing.assert_allclose(out["loss"], 0.1 * update * per_unit, rtol=1e-6)
    if transform == "kl_penalty":
        np.testing.assert_allclose(coefs, [0.3, 0.3, 0.4], rtol=1e-6)


# ---- new transforms -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "reward,row_weight,expected",
    [
        # Group-centred [.5, -.5 | 1, -1 | 4.5, -4.5]; the dropped third group counts in no
        # statistic: mean 0, var (ddof 1) = (.25 + .25 + 1 + 1) / 3 = 5/6, std 0.912871.
        (
            [1, 0, 3, 1, 9, 0],
            [1, 1, 1, 1, 0, 0],
            [0.547723, -0.547723, 1.095445, -1.095445, 4.929503, -4.929503],
        ),
        # Group-centred [.5, -.5 | .5, -.5] with the last row out: batch mean over .5, -.5, .5
        # is 1/6; deviations 1/3, -2/3, 1/3 give var 1/3, std 0.577350; A = (a - 1/6) / std.
        ([1, 0, 1, 0], [1, 1, 1, 0], [0.577350, -1.154701, 0.577350, -1.154701]),
    ],
)
def test_reinforce_pp_baseline_hand_values(reward, row_weight, expected):
    n = len(reward)
    terms = {
        "reward": jnp.asarray(reward, jnp.float32),
        "row_weight": jnp.asarray(row_weight, jnp.float32),
        "mask": jnp.ones((n, 3), bool),
    }
    out = _run(obj.reinforce_pp_baseline(group_size=2, eps=0.0), terms)
    np.testing.assert_allclose(out["advantage"][:, 0], expected, rtol=1e-5)
    np.testing.assert_array_equal(out["advantage"][:, 2], out["advantage"][:, 0])


# Per-token entropies for MASK; 5.0 and 9.0 sit on masked tokens and must be ignored. The ten
# real tokens, highest first: .9 (row 0, t 1), .8 (1, 0), .7 (2, 2), .6 (2, 1), .5, ...
ENTROPY = np.array(
    [[0.1, 0.9, 0.3, 0.5], [0.8, 0.2, 5.0, 5.0], [0.4, 0.6, 0.7, 9.0], [0.05, 9.0, 9.0, 9.0]],
    np.float32,
)


@pytest.mark.parametrize(
    "rho,kept",
    [
        (0.2, [(0, 1), (1, 0)]),  # ceil(0.2 * 10) = 2 tokens.
        (0.25, [(0, 1), (1, 0), (2, 2)]),  # ceil(2.5) = 3.
        (0.01, [(0, 1)]),  # At least one.
        (1.0, list(zip(*np.nonzero(MASK), strict=True))),
    ],
)
def test_high_entropy_tokens_keeps_the_top_rho(rho, kept):
    terms = {"mask": jnp.asarray(MASK), "entropy": jnp.asarray(ENTROPY)}
    out = _run(obj.high_entropy_tokens(rho), terms)
    expected = np.zeros_like(MASK)
    for i, t in kept:
        expected[i, t] = True
    np.testing.assert_array_equal(out["mask"], expected)
    assert float(out["metrics"]["high_entropy_frac"]) == pytest.approx(len(kept) / 10)


def test_high_entropy_tokens_gradient_and_kept_token_normaliser():
    # With A = 1 and loss -A logp, token_mean over the two kept tokens: d loss / d logp is
    # -1/2 at (0, 1) and (1, 0), 0 elsewhere; seq_mean_token_mean counts rows 0 and 1 only,
    # each with its one kept token: -1/2 at the same two tokens.
    terms = {
        "mask": jnp.asarray(MASK),
        "entropy": jnp.asarray(ENTROPY),
        "advantage": jnp.ones(MASK.shape),
    }
    expected = np.zeros(MASK.shape)
    expected[0, 1] = expected[1, 0] = -0.5
    for mode in ("token_mean", "seq_mean_token_mean"):
        tx = obj.chain(obj.high_entropy_tokens(0.2), obj.policy_gradient(), obj.aggregate(mode))

        def loss(logp, tx=tx):
            out = _run(tx, {**terms, "logp": logp})
            return out["loss_sum"] / out["denominator"]

        g = jax.grad(loss)(-jnp.ones(MASK.shape))
        np.testing.assert_allclose(g, expected, rtol=1e-6)


# ---- registry: parse, check, build --------------------------------------------------------

SCALERL = (
    "group_advantages(scale=batch_std) | token_ratio | cispo(eps_max=4.0)"
    " | aggregate(mode=prompt_mean)"
)


def test_parse():
    assert registry.parse(SCALERL) == [
        ("group_advantages", {"scale": "batch_std"}),
        ("token_ratio", {}),
        ("cispo", {"eps_max": 4.0}),
        ("aggregate", {"mode": "prompt_mean"}),
    ]
    assert registry.parse(" aggregate( mode = 'prompt_mean' )|x") == [
        ("aggregate", {"mode": "prompt_mean"}),
        ("x", {}),
    ]
    assert registry.parse("f(a=None, b=-3e-4, c=(1, 2), d=True, e=none)") == [
        ("f", {"a": None, "b": -3e-4, "c": (1, 2), "d": True, "e": "none"})
    ]
    assert registry.parse("") == []


@pytest.mark.parametrize(
    "spec,message",
    [
        ("token_ratio | f(1)", "objective.chain: 'f(1)': arguments are key=value"),
        ("token_ratio || aggregate", "objective.chain: an empty transform between '|'s"),
        ("cispo(eps_max=4.0", "objective.chain: cannot parse 'cispo(eps_max=4.0'"),
        ("aggregate(mode=a-b)", "objective.chain: 'aggregate(mode=a-b)': a - b is not a literal"),
    ],
)
def test_check_unparseable(spec, message):
    problems = registry.check(spec, group_size=2, max_len=4)
    assert len(problems) == 1 and problems[0].startswith(message), problems


@pytest.mark.parametrize(
    "spec,message",
    [
        (
            "group_advantages | token_ratio | cipso | aggregate(mode=token_mean)",
            "objective.chain: unknown transform 'cipso'; did you mean 'cispo'?",
        ),
        (
            "group_advantages | cispo(eps_max=4.0) | aggregate(mode=token_mean)",
            "objective.chain: cispo needs term 'ratio', which nothing before it provides "
            "(add one of: token_ratio, sequence_ratio)",
        ),
        (
            "group_advantages | token_ratio | ppo_clip(eps_hi=0.28) | aggregate(mode=token_mean)",
            "objective.chain: ppo_clip has no argument 'eps_hi'; did you mean 'eps_high'? "
            "(its arguments: eps_low, eps_high, dual_clip)",
        ),
        (
            "group_advantages | token_ratio | ppo_clip(dual_clip=0.5) | aggregate(mode=token_mean)",
            "objective.chain: ppo_clip: dual_clip=0.5 must be > 1",
        ),
        (
            "group_advantages | token_ratio | ppo_clip | aggregate(mode=mean)",
            "objective.chain: aggregate: aggregation 'mean' is not one of ('token_mean', "
            "'seq_mean_token_mean', 'seq_sum', 'prompt_mean')",
        ),
        (
            "group_advantages | token_ratio | cispo(eps_max=none) | aggregate(mode=token_mean)",
            "objective.chain: cispo(eps_max='none'): expected float or None",
        ),
        (
            "token_ratio | group_advantages | ppo_clip | aggregate(mode=token_mean)",
            "objective.chain: group_advantages runs once on the whole batch (stage 'batch') but "
            "comes after the loss-stage token_ratio; move it before token_ratio",
        ),
        (
            "group_advantages | token_ratio | ppo_clip",
            "objective.chain: the loss stage ends in ppo_clip, not an aggregation that provides "
            "loss_sum and denominator (end with one of: aggregate, dpo, ipo, simpo, kto)",
        ),
        (
            "group_advantages | token_ratio | truncated_is | ppo_clip | aggregate(mode=token_mean)",
            "objective.chain: truncated_is needs term 'loss', which nothing before it provides "
            "(add one of: value_loss, ppo_clip, cispo, policy_gradient, kl_penalty, "
            "entropy_bonus, rollout_kl)",
        ),
        (
            "group_advantages | kl_in_reward | token_ratio | ppo_clip | aggregate(mode=token_mean)",
            "objective.chain: kl_in_reward changes term 'reward' after group_advantages read it, "
            "and nothing after it reads it; move it before group_advantages",
        ),
        (
            "gae | token_ratio | ppo_clip | aggregate(mode=token_mean)",
            "objective.chain: gae reads the value head (old_value), which nothing in the chain "
            "trains (add one of: value_loss)",
        ),
        (
            "group_advantages | token_ratio(behaviour=sampler) | cispo"
            " | aggregate(mode=token_mean)",
            "objective.chain: token_ratio: behaviour='sampler' is not one of ('generator', "
            "'trainer'): 'generator' divides by the logprobs the tokens were sampled with "
            "(sampler_logp), 'trainer' by the trainer's recomputation at the start of the update "
            "(old_logp)",
        ),
    ],
)
def test_check_names_each_problem(spec, message):
    assert registry.check(spec, group_size=2, max_len=4) == [message]


def test_check_lists_every_problem_under_its_key():
    problems = registry.check(
        "token_ratio | cipso | group_advantages(baseline=median)",
        group_size=2,
        max_len=4,
        key="x.chain",
    )
    assert problems == [
        "x.chain: unknown transform 'cipso'; did you mean 'cispo'?",
        "x.chain: group_advantages: baseline='median' is not one of ('group_mean', 'rloo')",
        "x.chain: group_advantages runs once on the whole batch (stage 'batch') but comes "
        "after the loss-stage token_ratio; move it before token_ratio",
    ]
    # A factory's message that already names the transform is not prefixed twice.
    chain = SCALERL.replace("cispo(eps_max=4.0)", "cispo(eps_max=None)")
    assert registry.check(chain, group_size=2, max_len=4) == [
        "objective.chain: cispo: eps_max is required for the ScaleRL form"
    ]
    # Run-supplied arguments reach the factories: a group of one has no group std.
    assert registry.check(config_lib.GRPO_CHAIN, group_size=1, max_len=4) == [
        "objective.chain: group_advantages: group_size=1: group_mean/group_std needs groups of >= 2"
    ]


def test_build_raises_with_every_problem():
    with pytest.raises(ValueError, match=r"^Invalid objective:\n  objective.chain: unknown"):
        registry.build("cipso | aggregate", group_size=2, max_len=4)


def test_build_injects_the_run_arguments():
    [(_, adv), _, _, (_, agg)] = registry.resolve(SCALERL, group_size=4, max_len=16)
    assert adv == {"group_size": 4, "scale": "batch_std"}
    assert agg == {"group_size": 4, "max_len": 16, "mode": "prompt_mean"}
    objective = registry.build(
        "kl_penalty(coef=0.1) | aggregate(mode=seq_sum)", group_size=2, max_len=16
    )
    t = _terms(ref_logp=jnp.zeros(MASK.shape))
    _, batch_state = objective.batch.update(t, objective.batch.init())
    assert batch_state == ()  # A chain of no batch transforms.
    out, _ = objective.loss.update(t, objective.loss.init())
    assert float(out["denominator"]) == 4 * 16  # seq_sum divides by max_len, not M = 4.


def test_registered_names_are_the_factories():
    assert set(registry.names()) == {
        "group_advantages",
        "reinforce_pp_baseline",
        "gae",
        "value_loss",
        "token_ratio",
        "sequence_ratio",
        "ppo_clip",
        "cispo",
        "policy_gradient",
        "truncated_is",
        "kl_penalty",
        "kl_in_reward",
        "entropy_bonus",
        "high_entropy_tokens",
        "aggregate",
        "dpo",
        "ipo",
        "simpo",
        "kto",
        "distill_advantage",
        "process_advantages",
        "icepop",
        "masked_is",
        "geometric_rejection",
        "k3_rejection",
        "m2po",
        "rollout_kl",
        "moe_aux",
    }
    for e in registry.entries():
        assert getattr(obj, e.name) is e.factory


@pytest.mark.parametrize(
    "spec,model_terms",
    [
        (SCALERL, {"logp"}),  # The ratio reads the generator's sampler_logp: no extra pass.
        (SCALERL.replace("token_ratio", "token_ratio(behaviour=trainer)"), {"logp", "old_logp"}),
        (SCALERL.replace("token_ratio", "token_ratio(behaviour=generator)"), {"logp"}),
        (SCALERL.replace("token_ratio", "sequence_ratio"), {"logp"}),
        (SCALERL.replace("token_ratio", "sequence_ratio(behaviour=trainer)"), {"logp", "old_logp"}),
        (SCALERL.replace("cispo(eps_max=4.0)", "ppo_clip | truncated_is"), {"logp", "old_logp"}),
        ("kl_in_reward | " + SCALERL, {"logp", "old_logp", "ref_logp"}),
    ],
)
def test_model_terms_follow_the_arguments(spec, model_terms):
    assert registry.build(spec, group_size=2, max_len=4).model_terms == model_terms


RUN = dict(group_size=2, max_len=4)


@pytest.fixture
def probe():
    """Registers a batch-stage transform whose required term follows its argument (the
    batch stage has no `logp`), and removes it afterwards."""

    @registry.register(
        "_probe",
        stage="batch",
        requires=("reward", registry.ByArg("source", {"old": "old_logp", "new": ("logp", "mask")})),
        provides=("reward",),
    )
    def _probe(source: str = "old") -> obj.Transform:
        if source not in ("old", "new", "unlisted"):  # "unlisted": a registration bug.
            raise ValueError(f"source={source!r}")
        return obj.stateless(lambda terms: terms)

    yield registry._REGISTRY["_probe"]
    del registry._REGISTRY["_probe"]


def test_requirements_chosen_by_an_argument(probe):
    assert probe.required() == ("reward", "old_logp")
    assert probe.required({"source": "new"}) == ("reward", "logp", "mask")
    assert probe.required({"source": "bad"}) == ("reward", "old_logp")  # The factory rejects it.
    assert "| `_probe` | batch | reward, old_logp (logp + mask if source=new) | reward |" in (
        registry.table()
    )
    tail = " | group_advantages | token_ratio | cispo | aggregate(mode=token_mean)"
    assert registry.check("_probe" + tail, **RUN) == []
    assert registry.check("_probe(source=new)" + tail, **RUN) == [
        "objective.chain: _probe needs term 'logp', which the run supplies only to the loss "
        "stage (in the differentiated loss, per micro-batch)"
    ]
    assert registry.check("_probe(source=unlisted)" + tail, **RUN) == [
        "objective.chain: _probe(source='unlisted'): the factory accepts it but its registration "
        "lists no terms for it"
    ]
    # A value the factory rejects, or of the wrong type (unhashable), is reported once.
    assert registry.check("_probe(source=bad) | _probe(source=[1])" + tail, **RUN) == [
        "objective.chain: _probe: source='bad'",
        "objective.chain: _probe(source=[1]): expected str",
    ]


def test_register_rejects_a_choice_without_a_listed_default():
    with pytest.raises(ValueError, match=r"ByArg\('mode'\) needs an argument 'mode' whose default"):
        registry.register(
            "_bad", stage="loss", requires=(registry.ByArg("mode", {"a": "logp"}),), provides=()
        )(lambda mode="b": None)
    with pytest.raises(ValueError, match=r"ByArg\('mode'\) needs an argument 'mode' whose default"):
        registry.register(
            "_bad", stage="loss", requires=(registry.ByArg("mode", {"a": "logp"}),), provides=()
        )(lambda: None)
    assert "_bad" not in registry.names()


def test_readme_lists_the_registry():
    with open(os.path.join(ROOT, "README.md")) as f:
        assert registry.table() in f.read()


# ---- configs ------------------------------------------------------------------------------


def _config(name, arg=None):
    path = os.path.join(ROOT, "configs", f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"config_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(arg)


RECIPES = (
    "grpo",
    "dapo",
    "drgrpo",
    "gspo",
    "cispo",
    "ppo",
    "quickstart",
    "scalerl",
    "distill",
    "dpo",
    "iterative_dpo",
    "rm_rl",
)
VARIANTS = (
    [(name, arg) for name in RECIPES for arg in (None, "smoke")]
    + [("scalerl", f"loss={loss}") for loss in ("ppo_clip", "gspo", "cispo")]
    + [
        ("scalerl", f"drop={c}")
        for c in ("cispo", "prompt_mean", "batch_std", "fp32_head", "zero_variance")
    ]
    + [("scalerl", "drop=no_positive_resampling"), ("scalerl", "drop=interruption")]
    + [("grpo", "baseline=reinforce_pp"), ("quickstart", "entropy_rho=0.2,smoke")]
    + [("rm_rl", "prm=/a/prm,smoke")]
    + [("math", f"recipe={r}{s}") for r in RECIPES[:5] + ("scalerl",) for s in ("", ",smoke")]
)


_RAN = set()  # Chains already run (many variants share one).


@pytest.mark.parametrize("name,arg", VARIANTS)
def test_every_config_chain_checks_and_runs(name, arg):
    c = _config(name, arg)
    G, M = c.batch.group_size, c.sampling.max_new_tokens
    assert registry.check(c.objective.chain, group_size=G, max_len=M) == []
    objective = registry.build(c.objective.chain, group_size=G, max_len=M)
    if (c.objective.chain, G) in _RAN:
        return
    _RAN.add((c.objective.chain, G))
    # The chain runs on the run's terms plus exactly its model terms: every term a transform
    # reads is declared.
    rng = np.random.default_rng(0)
    N, M = 2 * G, 5
    run = {
        "reward": jnp.asarray(rng.integers(0, 2, N), jnp.float32),
        "correct": jnp.asarray(rng.integers(0, 2, N), bool),
        "mask": jnp.asarray(np.arange(M)[None] < rng.integers(1, M + 1, (N, 1))),
        "row_weight": jnp.ones(N),
        "sampler_logp": -jnp.asarray(rng.uniform(0.1, 2, (N, M)), jnp.float32),
    }
    if "step_reward" in objective.reads:  # A PRM's step rewards (the rollout stage's).
        run["step_mask"] = jnp.asarray(rng.integers(0, 2, (N, M)), bool)
        run["step_reward"] = jnp.asarray(rng.uniform(0, 1, (N, M)), jnp.float32)
    model = {t: -jnp.asarray(rng.uniform(0.1, 2, (N, M)), jnp.float32) for t in obj.MODEL_TERMS}
    batch_terms = {t: model[t] for t in objective.model_terms if t.startswith(("old_", "ref_"))}
    out, _ = objective.batch.update({**run, **batch_terms}, objective.batch.init())
    loss_terms = {t: model[t] for t in objective.model_terms}
    out, _ = objective.loss.update(
        {**out, **loss_terms, "update": jnp.asarray(0, jnp.int32)}, objective.loss.init()
    )
    assert np.isfinite(float(out["loss_sum"])) and float(out["denominator"]) > 0


@pytest.mark.parametrize(
    "name,arg,model_terms",
    [
        ("grpo", None, {"logp", "ref_logp"}),
        ("ppo", None, {"logp", "value", "old_value"}),
        ("scalerl", None, {"logp"}),
        ("quickstart", "entropy_rho=0.2", {"logp", "entropy"}),
        ("distill", None, {"logp", "teacher_logp"}),  # The teacher's pass: the rollouts'.
        ("dpo", None, {"logp", "ref_logp"}),
    ],
)
def test_model_terms(name, arg, model_terms):
    c = _config(name, arg)
    G, M = c.batch.group_size, c.sampling.max_new_tokens
    assert registry.build(c.objective.chain, group_size=G, max_len=M).model_terms == model_terms
