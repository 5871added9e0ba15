"""Objective transforms against hand-computed values, gradients and accumulation invariances."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlscale import objectives as obj

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
        "old_logp": jnp.asarray(logp + rng.normal(0, 0.3, MASK.shape), jnp.float32),
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


def test_ratios():
    t = _terms()
    out = _run(obj.token_ratio(), t)
    np.testing.assert_allclose(out["ratio"], np.exp(t["logp"] - t["old_logp"]), rtol=1e-6)
    seq = _run(obj.sequence_ratio(), t)["ratio"]
    d = np.asarray((t["logp"] - t["old_logp"]) * MASK)
    expected = np.exp(d.sum(1) / MASK.sum(1))
    np.testing.assert_allclose(seq[:, 0], expected, rtol=1e-6)
    np.testing.assert_allclose(seq[:, -1], expected, rtol=1e-6)


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
        terms = {**t, "logp": logp, "ratio": jnp.exp(logp - t["old_logp"])}
        out = _run(obj.chain(form, obj.aggregate("token_mean")), terms)
        return out["loss_sum"]

    for form, weight in [
        (obj.cispo(eps_max=1.1), lambda r: np.minimum(r, 1.1)),
        (obj.cispo(eps_max=None, eps_low=0.1, eps_high=0.2), lambda r: np.clip(r, 0.9, 1.2)),
    ]:
        g = jax.grad(loss)(t["logp"], form)
        r = np.exp(np.asarray(t["logp"] - t["old_logp"]))
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
    old_logp = jax.lax.stop_gradient(_policy(theta, tokens))

    def grad(transform, agg="seq_mean_token_mean"):
        def loss(theta):
            terms = {
                "mask": jnp.asarray(MASK),
                "reward": jnp.asarray(REWARD),
                "logp": _policy(theta, tokens),
                "old_logp": old_logp,
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


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean", "seq_sum", "prompt_mean"])
def test_accumulation_over_micro_batches_gives_the_same_gradient(agg):
    theta, tokens = _toy(n_rows=8, seed=1)
    rng = np.random.default_rng(2)
    mask = jnp.asarray(np.arange(4)[None] < rng.integers(1, 5, (8, 1)))
    reward = jnp.asarray(rng.integers(0, 2, 8).astype(np.float32))
    old_logp = jax.lax.stop_gradient(_policy(theta, tokens)) + 0.05
    chain = obj.chain(
        obj.group_advantages(2, "group_mean", "batch_std"),
        obj.token_ratio(),
        obj.cispo(eps_max=1.02),
        obj.aggregate(agg, group_size=2, max_len=4),
    )
    # Advantages use batch statistics: compute them once on the full batch, as the loop does.
    adv = _run(chain, {"mask": mask, "reward": reward, "logp": old_logp, "old_logp": old_logp})[
        "advantage"
    ]
    loss_chain = obj.chain(
        obj.token_ratio(), obj.cispo(eps_max=1.02), obj.aggregate(agg, group_size=2, max_len=4)
    )

    def sums(theta, rows):
        terms = {
            "mask": mask[rows],
            "advantage": adv[rows],
            "old_logp": old_logp[rows],
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
        "logp": logp,
        "ref_logp": ref,
        "mask": jnp.ones((1, 2), bool),
        "reward": jnp.asarray([1.0]),
    }
    out = _run(obj.kl_penalty(0.1, "k1", where="reward"), terms)
    assert float(out["reward"][0]) == pytest.approx(1.0 - 0.1 * (0.5 - 1.0))
    out = _run(obj.kl_penalty(lambda step: 0.5, "k2"), terms)
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
    with pytest.raises(KeyError, match=r"ppo_clip needs term\(s\) \['ratio'\]"):
        _run(obj.ppo_clip(), {"advantage": 1.0, "mask": jnp.ones((1, 1))})
    with pytest.raises(ValueError, match="5 rows are not whole groups of 2"):
        _run(obj.group_advantages(2), {"reward": jnp.ones(5), "mask": jnp.ones((5, 1))})
