"""Off-policy corrections (`objectives.corrections`) against hand-computed values on batches
with known ratios (one at a bfloat16 generator's scale), jitted; their start-up messages; and
one smoke run chaining them all, its generator in bfloat16."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import load_config, metric_lines, rounding
from test_generator_precision import tensorboard_histograms

from rlscale import objectives as obj
from rlscale import rl
from rlscale.objectives import registry

# Three rows with 4, 3 and 2 trained tokens; log rho = old_logp - sampler_logp as written.
MASK = np.array([[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 0, 0]], bool)
LOG_RHO = np.array(
    [
        [0.0, 0.1, -0.9, 1.8],  # rho = 1, 1.105, 0.407, 6.05
        [0.2, -0.2, 0.3, 7.0],  # 1.22, 0.819, 1.35; the padding's 7 is never read
        [0.0005, -0.0005, 0.0, 0.0],  # geometric mean exactly 1
    ]
)
SAMPLER = -np.linspace(0.5, 2.0, 12).reshape(3, 4)


def _terms(**extra):
    return {
        "mask": jnp.asarray(MASK),
        "sampler_logp": jnp.asarray(SAMPLER, jnp.float32),
        "old_logp": jnp.asarray(SAMPLER + LOG_RHO, jnp.float32),
        **extra,
    }


def _run(transform, terms):
    """The transform's update, jitted as the learner runs it."""
    out, _ = jax.jit(transform.update)(terms, transform.init())
    return out


# float32 log rho from two float32 logprobs of magnitude <= 2: a few roundings of 2.
EPS = 8 * rounding(4) * 2.0


def _fractions(out, name, tokens, seqs):
    # Whole counts over 9 tokens and 3 rows: exact up to one division.
    assert float(out["metrics"][f"{name}_masked_tokens"]) == pytest.approx(tokens / 9, rel=1e-6)
    assert float(out["metrics"][f"{name}_masked_seqs"]) == pytest.approx(seqs / 3, rel=1e-6)


def test_icepop_masks_tokens_outside_the_band():
    out = _run(obj.icepop(low=0.5, high=5.0), _terms())
    # rho 0.407 < 0.5 and 6.05 > 5 leave; the padding stays out.
    keep = MASK.copy()
    keep[0, 2:] = False
    np.testing.assert_array_equal(out["mask"], keep)
    _fractions(out, "icepop", tokens=2, seqs=1)


@pytest.mark.parametrize(
    "level,keep_rows,weights",
    [
        # Token: rho in [0.5, 2] weights its token; row 0's 0.407 and 6.05 are rejected.
        ("token", None, np.exp(LOG_RHO) * [[1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 1, 1]]),
        # Sequence: prod rho = e^1.0 (out), e^0.3 (in), e^0 (in), on every token of the row.
        ("sequence", [False, True, True], np.exp([[0.0] * 4, [0.3] * 4, [0.0] * 4])),
    ],
)
def test_masked_is_weights_inside_and_rejects_outside(level, keep_rows, weights):
    out = _run(obj.masked_is(low=0.5, high=2.0, level=level), _terms(loss=jnp.ones((3, 4))))
    if level == "token":
        keep = MASK & (weights > 0)
        _fractions(out, "masked_is", tokens=2, seqs=1)
    else:
        keep = MASK & np.array(keep_rows)[:, None]
        _fractions(out, "masked_is", tokens=4, seqs=1)
    np.testing.assert_array_equal(out["mask"], keep)
    np.testing.assert_allclose(
        np.where(keep, out["loss"], 0.0), np.where(keep, weights, 0.0), rtol=EPS
    )
    assert float(out["metrics"]["masked_is_weight_mean"]) == pytest.approx(
        weights[keep].mean(), rel=EPS
    )


def test_geometric_rejection_uses_the_mean_log_ratio():
    # Geometric means per row: e^(1.0 / 4) = 1.28, e^(0.3 / 3) = 1.105, e^0: only row 2 is
    # inside 1 +- 0.05.
    out = _run(obj.geometric_rejection(low=0.95, high=1.05), _terms())
    np.testing.assert_array_equal(out["mask"], MASK & np.array([[0], [0], [1]], bool))
    _fractions(out, "geometric_rejection", tokens=7, seqs=2)
    # A band 1 +- 1e-3 keeps row 2 (mean 0) however tight a per-token band would have to be.
    out = _run(obj.geometric_rejection(low=0.999, high=1.001), _terms())
    assert np.asarray(out["mask"])[2].tolist() == [True, True, False, False]


# bfloat16's unit roundoff: a bfloat16 generator's |log rho| is a few of it per token
# (test_generator_precision).
U_BF16 = 2.0**-8


def test_bands_at_the_bfloat16_generators_scale():
    """Per-token log rho of a few bfloat16 roundings: icepop's, masked_is's, k3's and M2PO's
    bands pass every token, and geometric_rejection's 1 +- 1e-3 (log band +-9.995e-4) tells
    rows whose mean log rho is 1.05e-3 and 5e-4 apart, which float32 logprobs of magnitude
    <= 2 resolve (their difference is within 2.4e-7 of log rho)."""
    log_rho = (
        np.array(
            [
                [2.6, 1.3, -0.8, 2.0],  # x u: mean 1.28 u = 5.0e-3, rejected
                [0.5, -0.25, 0.14, 7.0],  # mean 0.13 u = 5.2e-4, kept
                [0.4, 0.1376, 0.0, 0.0],  # mean 0.2688 u = 1.05e-3, rejected
            ]
        )
        * U_BF16
    )
    terms = {**_terms(), "old_logp": jnp.asarray(SAMPLER + log_rho, jnp.float32)}
    out = _run(obj.geometric_rejection(low=0.999, high=1.001), terms)
    np.testing.assert_array_equal(out["mask"], MASK & np.array([[0], [1], [0]], bool))
    _fractions(out, "geometric_rejection", tokens=6, seqs=2)
    for transform in (obj.icepop(), obj.k3_rejection(max_kl=0.001), obj.m2po(tau=0.04)):
        np.testing.assert_array_equal(_run(transform, terms)["mask"], MASK)
    out = _run(obj.masked_is(low=0.5, high=2.0), {**terms, "loss": jnp.ones((3, 4))})
    np.testing.assert_array_equal(out["mask"], MASK)


def test_k3_rejection_against_numpy():
    rho = np.exp(LOG_RHO)
    k3 = np.where(MASK, rho - 1 - LOG_RHO, 0.0)
    row_kl = k3.sum(1) / MASK.sum(1)  # About [1.32, 0.026, 1.25e-7].
    max_kl = 0.05
    out = _run(obj.k3_rejection(max_kl=max_kl), _terms())
    np.testing.assert_array_equal(out["mask"], MASK & (row_kl <= max_kl)[:, None])
    _fractions(out, "k3_rejection", tokens=4, seqs=1)
    assert float(out["metrics"]["k3_rejection_kl"]) == pytest.approx(k3.sum() / 9, rel=1e-5)


def _m2po_reference(log_rho, mask, tau):
    """Algorithm 1 as written: mask the largest (log rho)^2, one at a time, until the mean
    over the kept tokens is <= tau."""
    keep = mask.copy()
    m2 = np.square(log_rho)
    while keep.any() and m2[keep].mean() > tau:
        masked = np.where(keep, m2, -1.0)
        keep[np.unravel_index(np.argmax(masked), masked.shape)] = False
    return keep


@pytest.mark.parametrize("tau", [10.0, 0.04, 0.3, 1e-9])
def test_m2po_masks_the_largest_second_moments(tau):
    out = _run(obj.m2po(tau=tau), _terms())
    keep = _m2po_reference(LOG_RHO, MASK, tau)
    np.testing.assert_array_equal(out["mask"], keep)
    masked = int(MASK.sum() - keep.sum())
    _fractions(out, "m2po", tokens=masked, seqs=int((MASK & ~keep).any(1).sum()))
    m2 = np.square(LOG_RHO)[MASK].mean()
    assert float(out["metrics"]["m2po_m2"]) == pytest.approx(m2, rel=1e-5)
    if tau == 0.04:  # 3.24 and 0.81 go; the kept 7 have mean 0.1425 / 7 = 0.02 <= 0.04.
        assert masked == 2


def test_m2po_random_batch_against_the_loop():
    rng = np.random.default_rng(0)
    mask = rng.random((8, 16)) < 0.7
    log_rho = rng.normal(0, 0.3, (8, 16))
    terms = {
        "mask": jnp.asarray(mask),
        "sampler_logp": jnp.zeros((8, 16), jnp.float32),
        "old_logp": jnp.asarray(log_rho, jnp.float32),
    }
    out = _run(obj.m2po(tau=0.02), terms)
    np.testing.assert_array_equal(out["mask"], _m2po_reference(log_rho, mask, 0.02))


def test_rollout_kl_adds_k2_with_a_gradient_toward_the_sampler():
    logp = jnp.asarray(SAMPLER + LOG_RHO, jnp.float32)
    coef = 0.1
    terms = _terms(logp=logp, loss=jnp.zeros((3, 4)))
    out = _run(obj.rollout_kl(coef=coef), terms)
    k2 = 0.5 * np.square(LOG_RHO)
    np.testing.assert_allclose(out["loss"], coef * k2, rtol=EPS, atol=1e-7)
    assert float(out["metrics"]["rollout_kl"]) == pytest.approx(k2[MASK].mean(), rel=1e-5)
    grad = jax.grad(
        lambda lp: jnp.sum(obj.rollout_kl(coef=coef).update({**terms, "logp": lp}, ())[0]["loss"])
    )(logp)
    np.testing.assert_allclose(grad, coef * LOG_RHO, rtol=EPS, atol=1e-7)


# ------------------------------------------------------------------------------------------
# Start-up checks, each naming the key.
# ------------------------------------------------------------------------------------------

CHAIN = "group_advantages | {} | token_ratio | ppo_clip | aggregate(mode=token_mean)"


@pytest.mark.parametrize(
    "part,message",
    [
        ("icepop(low=5.0, high=0.5)", "icepop: low=5.0, high=0.5: the band needs 0 <= low < high"),
        (
            "geometric_rejection(low=1.001, high=0.999)",
            "geometric_rejection: low=1.001, high=0.999: the band needs 0 <= low < high",
        ),
        ("m2po(tau=0)", "m2po: tau=0 must be > 0"),
        ("m2po(tau=-0.1)", "m2po: tau=-0.1 must be > 0"),
        ("k3_rejection(max_kl=0.0)", "k3_rejection: max_kl=0.0 must be > 0"),
    ],
)
def test_bad_arguments_name_the_key(part, message):
    assert registry.check(CHAIN.format(part), group_size=2, max_len=4) == [
        f"objective.chain: {message}"
    ]


def test_bad_loss_stage_arguments_name_the_key():
    chain = "group_advantages | token_ratio | ppo_clip | {} | aggregate(mode=token_mean)"
    assert registry.check(chain.format("masked_is(level=row)"), group_size=2, max_len=4) == [
        "objective.chain: masked_is: masked_is level='row': 'token' or 'sequence'"
    ]
    assert registry.check(chain.format("masked_is(low=3, high=2)"), group_size=2, max_len=4) == [
        "objective.chain: masked_is: low=3, high=2: the band needs 0 <= low < high"
    ]
    assert registry.check(chain.format("rollout_kl(coef=-1.0)"), group_size=2, max_len=4) == [
        "objective.chain: rollout_kl: coef=-1.0 must be > 0"
    ]


def test_a_run_without_generator_logprobs_fails_naming_the_chain():
    """Greedy samples carry no logprobs (0): a correction reads them, so the run stops at
    start-up, naming objective.chain and why."""
    config = load_config("off_policy", "smoke,correction=all")
    config.sampling.temperature = 0.0
    with pytest.raises(ValueError) as e:
        rl.resolve(config)
    text = str(e.value)
    why = (
        "which this run does not supply: sampling.temperature=0 (greedy) gives the sampled "
        "tokens no logprobs"
    )
    for name in (
        "icepop",
        "geometric_rejection",
        "k3_rejection",
        "m2po",
        "masked_is",
        "rollout_kl",
    ):
        assert f"objective.chain: {name} needs term 'sampler_logp', {why}" in text
    # The registry's own check, with the run's absent terms.
    assert registry.check(
        CHAIN.format("icepop"), group_size=2, max_len=4, absent={"sampler_logp": "none"}
    ) == [
        f"objective.chain: {name} needs term 'sampler_logp', which this run does not supply: none"
        for name in ("icepop", "token_ratio")
    ]


def test_every_variant_builds():
    for name in (
        "icepop",
        "masked_is",
        "geometric_rejection",
        "k3_rejection",
        "m2po",
        "rollout_kl",
        "all",
    ):
        config = load_config("off_policy", f"correction={name}")
        objective = obj.build(config.objective.chain, group_size=4, max_len=8)
        assert "old_logp" in objective.model_terms or name == "rollout_kl", name
    with pytest.raises(ValueError, match="correction='tis' is not one of icepop"):
        load_config("off_policy", "correction=tis")


# ------------------------------------------------------------------------------------------
# One smoke run, every correction at once, reusing the shared warm start.
# ------------------------------------------------------------------------------------------

MASKED = [
    f"train/{name}_masked_{what}"
    for name in ("icepop", "geometric_rejection", "k3_rejection", "m2po", "masked_is")
    for what in ("tokens", "seqs")
]


def off_policy_smoke(warm, shared_workdir):
    """The off_policy config's smoke run with every correction, its generator in bfloat16
    (the config's default), reusing the shared warm start: (config, workdir)."""
    config = load_config("off_policy", "smoke,correction=all")
    config.sft.reuse_from = str(warm)
    config.mesh.shape = (1, 1, 1)  # One device: the gap is the generator's dtype, not a layout.
    workdir = shared_workdir("recipe_off_policy_all", lambda w: rl.run(rl.resolve(config), str(w)))
    return config, workdir


def test_smoke_run_reports_every_correction(warm, shared_workdir):
    """A synchronous run whose generator samples in bfloat16 beside the float32 learner: the
    gap is a few bfloat16 roundings per token (float32's is 5e-7, test_rl), the corrections
    whose band is that narrow mask, the others do not, and TensorBoard has the per-token
    log-ratio histogram of every step."""
    config, workdir = off_policy_smoke(warm, shared_workdir)
    train = metric_lines(workdir)[1:]
    assert len(train) == config.steps
    for line in train:
        assert np.isfinite(line["train/loss"])
        for key in MASKED:
            assert 0.0 <= line[key] <= 1.0, (key, line[key])
        # The window of test_generator_precision's sampler-level gap (measured here, on one
        # device: 4.1e-3 to 4.7e-3, 1.05-1.2 u). 1 - r is about Var(p dlogp) / 2 Var(p), 0.9e-5
        # to 1.5e-5; float32's r is 1 within 3e-7 (tests/golden).
        assert U_BF16 / 4 < line["train/logp_gap_abs"] < 16 * U_BF16, line
        assert line["train/prob_pearson"] < 1.0 - 1e-6, line
        # geometric_rejection's 1 +- 1e-3 on a sequence's mean log rho is narrower than the
        # bfloat16 gap (test_bands_at_the_bfloat16_generators_scale): it rejects sequences.
        # The other bands lie orders of magnitude beyond a few u: nothing.
        assert line["train/geometric_rejection_masked_seqs"] > 0.0, line
        for name in ("icepop", "k3_rejection", "m2po", "masked_is"):
            assert line[f"train/{name}_masked_tokens"] == 0.0, (name, line)
        assert 0.0 < line["train/m2po_m2"] < (16 * U_BF16) ** 2
    hists = tensorboard_histograms(workdir)
    for step in range(1, config.steps + 1):
        h = hists["train/log_ratio", step]
        assert h.num > 0 and sum(h.bucket) == h.num
        # Most tokens' |log rho| in (1e-4, 1e-1]: bfloat16's decades, not float32's.
        # The buckets (-0.1, -0.01], ..., (-1e-3, -1e-4] and (1e-4, 1e-3], ..., (0.01, 0.1]
        # (`logp_match.LIMITS`): upper limits in [-0.01, -1e-4], lower in [1e-4, 0.01].
        limits = list(h.bucket_limit)
        low = sum(c for c, hi in zip(h.bucket, limits) if -0.05 < hi < -5e-5)
        high = sum(c for c, lo in zip(h.bucket, [-np.inf] + limits) if 5e-5 < lo < 0.05)
        assert low + high > h.num / 2, list(h.bucket)
    with open(workdir / "summary.json") as f:
        assert json.load(f)["compute/flops"] > 0
