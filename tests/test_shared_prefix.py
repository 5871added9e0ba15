"""`learner.shared_prefix`: a group's prompt once per packed row, then its samples' own
tokens. The mask against a NumPy construction from the sequences; the shared rows' logprobs
and the gradient of a GRPO loss against the plain packed rows' (groups with unequal
completions, padding, tokens out of the loss as a multi-turn reply's are, a group split over
rows, a group whose prompts differ, a sample with nothing to train); the start-up checks."""

import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import jit_without_ynn, load_config, rounding

from rlscale import config_lib, model, objectives, sections, sharding
from rlscale.model import attention, decoder
from rlscale.rl import batch_layout, checks, forward, run_config
from rlscale.sampling import SamplingConfig

G, B, P, M = 4, 4, 6, 8
N = B * G
T, ROWS = 24, 4  # Tokens per packed row, rows per batch shard.
# Each logprob is float32 sums of about 1,400 terms (tests/test_learner.py's PER_TOKEN: the
# same two-layer model; here attention over at most 14 positions).
PER_TOKEN = rounding(2**11)


def test_mask_is_the_sequences_own_tokens_and_their_prompt():
    """A hand-built row: a 3-token prompt (prefix segment 5), completions A (segment 1: the
    prompt's last token copied, then 2 tokens) and B (segment 2: 1 + 3 tokens), another
    sequence (segment 3, no prefix) and padding. Each query sees exactly the earlier tokens
    of its own sequence: its prompt and its own completion, never the other completion's."""
    segments = np.array([5, 5, 5, 1, 1, 1, 2, 2, 2, 2, 3, 3, 0, 0])
    prefixes = np.array([5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 3, 3, 0, 0])
    # The sequences as lists of row indices, in order (the NumPy construction's only input).
    sequences = [[0, 1, 2, 3, 4, 5], [0, 1, 2, 6, 7, 8, 9], [10, 11]]
    expected = np.zeros((14, 14), bool)
    for seq in sequences:
        for a, i in enumerate(seq):
            expected[i, seq[: a + 1]] = True  # A prompt token's row is the same in both.
    mask = attention.training_mask(
        None, jnp.asarray(segments)[None], 0, jnp.asarray(prefixes)[None]
    )
    np.testing.assert_array_equal(np.asarray(mask.mask_BTS[0]), expected)
    with pytest.raises(ValueError, match="model.sliding_window=4 .* learner.shared_prefix"):
        attention.training_mask(None, jnp.asarray(segments)[None], 4, jnp.asarray(prefixes)[None])


def _rollouts(vocab: int):
    """Groups of one left-padded prompt each (2-6 tokens; group 3's prompts differ, as no
    group's should: it is packed unshared), completions of 1-8 tokens (padding after), a
    tenth of their tokens out of the loss (as a multi-turn reply's), and one sample with no
    trained token."""
    rng = np.random.default_rng(0)
    prompt_B = np.array([6, 2, 5, 4])
    tokens = rng.integers(1, vocab, (N, P + M)).astype(np.int32)
    tokens[:, :P] = np.repeat(tokens[::G, :P], G, axis=0)
    tokens[3 * G + 1, P - 1] += 1  # Group 3: another prompt.
    completion = rng.integers(1, M + 1, N)
    completion[:G] = [3, 5, 2, 4]  # Group 0: 5 + 4 + 6 + 3 + 5 tokens, one row.
    completion[G : 2 * G] = M  # Group 1: 1 + 4 x 9 tokens, longer than a row.
    prompt_N = np.repeat(prompt_B, G)
    attn = np.concatenate(
        [np.arange(P)[None] >= P - prompt_N[:, None], np.arange(M)[None] < completion[:, None]],
        1,
    )
    tokens[~attn] = 0
    mask = attn[:, P:] & (rng.random((N, M)) > 0.1)
    mask[2 * G + 2] = False  # Nothing to train: not placed; its group shares without it.
    return types.SimpleNamespace(
        tokens_NL=tokens,
        attn_mask_NL=attn,
        mask_NM=mask,
        reward_N=rng.integers(0, 2, N).astype(np.float32),
        correct_N=np.zeros(N, bool),
        row_weight_N=np.ones(N, np.float32),
        sampler_logp_NM=np.where(attn[:, P:], -rng.exponential(5.0, (N, M)), 0.0).astype(
            np.float32
        ),
        prompt_len=P,
    )


def _layout(shared: bool) -> batch_layout.Layout:
    return batch_layout.Layout(T, ROWS, G, 1, M, 1, shared_prefix=shared)


@pytest.fixture(scope="module")
def setup():
    cfg = model.get("tiny", num_layers=2)
    graphdef, _ = model.abstract_model(cfg)
    params = model.init_params(cfg, jax.random.key(0))
    return graphdef, params, _rollouts(cfg.vocab_size)


def _packed_logp(graphdef, roll, mesh, shared: bool):
    """(logp(params) [N, M], 0 off the loss, from the layout's packed rows; its plan)."""
    plan = batch_layout.plan(
        roll, np.arange(N)[None], _layout(shared), shards=2, placed_N=roll.mask_NM.any(1)
    )
    place = {k: v[0] for k, v in plan.place.items()}
    batch = {"tokens": plan.tokens_NL, "attn": plan.attn_NL, "mask": roll.mask_NM}
    spec = decoder.ForwardSpec(
        graphdef=graphdef,
        mesh=mesh,
        logits_cfg=SamplingConfig(temperature=0.7),
        pack_length=T,
        pack_rows=ROWS,
        shared_prefix=shared,
    )

    def logp(p):
        out = jnp.zeros((N, M))
        for u in range(plan.count[0]):
            fwd, in_N = forward.packed_micro(spec, batch, place, u)
            t = forward.token_terms(spec, p, None, fwd, ("logp",))
            out = jnp.where(in_N[:, None], t["logp"], out)
        return jnp.where(roll.mask_NM, out, 0.0)

    return logp, plan


def test_shared_rows_hold_each_prompt_once_per_row(setup):
    """Group 0 shares one row (its prompt but the last token once, each sample's last
    prompt token and completion after it); group 1 (37 tokens) is split over two rows, the
    prompt in each; group 3 (prompts differ) shares nothing; the plain layout writes more
    tokens."""
    graphdef, _, roll = setup
    mesh = sharding.make_mesh((2, 1, 1))
    _, plain = _packed_logp(graphdef, roll, mesh, False)
    _, shared = _packed_logp(graphdef, roll, mesh, True)
    place = {k: v[0] for k, v in shared.place.items()}
    lead = place["lead"]
    shared_N = np.repeat([5, 1, 4, 0], G)
    shared_N[2 * G + 2] = 0  # Not placed.
    assert list(place["shared"]) == list(shared_N)
    assert set(lead[:G]) == {lead[0]} and set(place["row"][:G]) == {place["row"][0]}
    assert len(set(lead[G : 2 * G])) >= 2  # Split, each part with its prefix.
    for k in ("row", "prefix"):  # A sample's prefix is its lead's, in its lead's row.
        assert np.array_equal(place[k][: 3 * G], place[k][lead[: 3 * G]])
    assert list(lead[3 * G :]) == list(range(3 * G, N))  # Prompts differ: none shared.
    written = [p.count[0] * T * ROWS * 2 * (1 - p.padding_frac) for p in (plain, shared)]
    length_N = roll.attn_mask_NL.sum(1) * roll.mask_NM.any(1)
    assert written[0] == pytest.approx(length_N.sum())
    saved = sum(int(place["shared"][n]) for n in range(N) if lead[n] != n and length_N[n])
    assert written[1] == pytest.approx(length_N.sum() - saved) and saved > 0


@pytest.mark.slow
@pytest.mark.isa_sensitive
def test_shared_prefix_equals_plain_logprobs_and_grpo_gradient(setup):
    """Each completion token's logprob, and the gradient of GRPO's loss (token ratio, PPO
    clip, per-sequence token means) over them, from shared-prefix rows and from plain packed
    rows (2 batch shards), within their float32 rounding.

    The two compute each logprob from the same terms summed in another order (another row
    position, other masked keys), so a logprob moves by `PER_TOKEN` |logp|. The gradient is
    sum_t c_t d logp_t, c_t = d loss / d logp_t: each contribution moves by `PER_TOKEN` in its
    forward and as much in its backward pass, by `PER_TOKEN` |logp_t| more through c_t (the
    ratio exp(logp_t - sampler_logp_t)), and the n tokens' sum by `rounding(n)`; as in
    tests/test_learner.py, an entry's bound follows its parameter's largest sum of
    contribution magnitudes (the backward pass's sums mix the cotangents every entry
    shares)."""
    graphdef, params, roll = setup
    mesh = sharding.make_mesh((2, 1, 1))
    logp_plain, _ = _packed_logp(graphdef, roll, mesh, False)
    logp_shared, _ = _packed_logp(graphdef, roll, mesh, True)
    objective = objectives.build(config_lib.GRPO_CHAIN, group_size=G, max_len=M)
    host = dict(
        mask=roll.mask_NM,
        reward=roll.reward_N,
        correct=roll.correct_N,
        row_weight=roll.row_weight_N,
        sampler_logp=roll.sampler_logp_NM,
    )
    terms, _ = objective.batch.update(jax.tree.map(jnp.asarray, host), objective.batch.init())
    terms.pop("metrics", None)

    def loss_of_logp(logp):
        out, _ = objective.loss.update({**terms, "logp": logp, "update": 0}, objective.loss.init())
        return out["loss_sum"] / out["denominator"]

    def value_and_grad(logp_fn):  # ((loss, logp), gradient).
        def loss(p):
            logp = logp_fn(p)
            return loss_of_logp(logp), logp

        return jax.jit(jax.value_and_grad(loss, has_aux=True))(params)

    (loss_p, lp_plain), grad_p = value_and_grad(logp_plain)
    (loss_s, lp_shared), grad_s = value_and_grad(logp_shared)
    assert np.all(np.abs(lp_shared - lp_plain) <= PER_TOKEN * np.abs(lp_plain))
    assert np.abs(lp_plain).min(where=roll.mask_NM, initial=np.inf) > 0  # Real logprobs.
    c_NM = np.abs(np.asarray(jax.grad(loss_of_logp)(lp_plain)))
    n = int(roll.mask_NM.sum())
    weight_NM = c_NM * (PER_TOKEN * (2 + np.abs(np.asarray(lp_plain))) + rounding(n))
    jac = jit_without_ynn(jax.jacrev(logp_plain))(params)
    tol = jax.tree.map(
        lambda j: np.max(np.einsum("nm,nm...->...", weight_NM, np.abs(np.asarray(j)))), jac
    )
    assert abs(loss_s - loss_p) <= np.sum(weight_NM * np.abs(np.asarray(lp_plain)))
    for path, a, b, t in zip(
        jax.tree_util.tree_leaves_with_path(grad_p), *map(jax.tree.leaves, (grad_s, grad_p, tol))
    ):
        assert np.all(np.abs(a - b) <= t), (path[0], np.abs(a - b).max(), t)
    assert max(float(np.abs(g).max()) for g in jax.tree.leaves(grad_p)) > 0


def test_start_up_refuses_what_cannot_share():
    """Each problem names its keys: one sequence per row, an attention that reads only
    segment ids, a sliding window."""
    c = load_config("quickstart")
    c.learner.shared_prefix, c.learner.pack_length = True, 0
    c.model.attention, c.model.sliding_window = "splash", 4
    with pytest.raises(sections.InvalidConfigError) as e:
        run_config.resolve(c)
    text = str(e.value)
    assert "learner.shared_prefix=True needs packed rows: learner.pack_length=0" in text
    assert "model.attention='splash' reads segment ids only" in text
    assert "learner.shared_prefix=True with model.sliding_window=4" in text
    c.learner.pack_length, c.model.attention, c.model.sliding_window = 96, "dot_product", 0
    run = run_config.resolve(c)
    assert run.learner.shared_prefix is True
    # Once the data is read: rows of 96 tokens hold a 20-token prompt and 2 samples of 1 + 32
    # tokens each (shared), or one 52-token sequence (plain); fewer rows than a group needs
    # split it over micro-batches (`Layout.split_groups`), but a 70-token prompt and 32
    # completion tokens fit no row.
    G, M = run.batch.group_size, run.sampling.max_new_tokens
    assert M == 32 and G % 2 == 0
    learner = dataclasses.replace(run.learner, pack_rows=G // 2)
    plain = dataclasses.replace(learner, shared_prefix=False)
    for u in (learner, plain):
        assert checks.pack_problems(u, run.batch, run.sampling, 20) == []
        (problem,) = checks.pack_problems(u, run.batch, run.sampling, 70)
        assert "learner.pack_length=96 cannot hold" in problem and "70 tokens" in problem
