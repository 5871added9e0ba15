"""The learner's update, against an independent re-derivation: packed forward rows (several
sequences per row, or one: `learner.pack_length=0`), trimmed to a length bucket, give the
losses, logprobs, gradients and parameters of a plain loop over full-length rows, no
recompile within a bucket, the ratio reads the generator's logprobs. Memory at real sizes:
chunked logprobs and entropy, rematerialized blocks and a host-offloaded reference give the
plain path's values and gradients; bfloat16 params keep float32 master weights and optimizer
state."""

import dataclasses
import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import jit_without_ynn, rounding

from rlscale import model, objectives, optim, programs, sharding
from rlscale.model import decoder
from rlscale.rl import batch_layout, forward, learner, logp_match
from rlscale.sampling import SamplingConfig, transform_logits

G, N, P, M = 2, 16, 6, 12
TEMPERATURE = 0.7
LR = 0.5
CHAIN = "group_advantages | token_ratio | cispo(eps_max=4.0) | aggregate(mode=prompt_mean)"
KL_CHAIN = CHAIN.replace(" | aggregate", " | kl_penalty(coef=0.1) | aggregate")
# float32 sums of about 1,400 terms in all compute each logprob (per layer about 500: norms,
# projections and the MLP over 64 and 128, attention over at most 18 positions; then the head
# and a logsumexp over the 256-token vocabulary): see `_loss_rounding`.
PER_TOKEN = rounding(2**11)
# One optimizer object: learners with equal settings have equal `Spec`s, so tests share
# their compiled updates (`programs`).
SGD = optax.sgd(LR)


def _learner(
    mesh,
    graphdef,
    chain=CHAIN,
    *,
    buckets=1,
    pack=0,
    pack_rows=0,
    minibatches=2,
    epochs=1,
    optimizer=None,
    **kw,
):
    layout = batch_layout.Layout(
        pack_length=pack,
        pack_rows=pack_rows,
        group_size=G,
        minibatches=minibatches,
        max_len=M,
        length_buckets=buckets,
    )
    return learner.Learner(
        graphdef=graphdef,
        objective=objectives.build(chain, group_size=G, max_len=M),
        optimizer=optimizer or SGD,
        mesh=mesh,
        logits_cfg=SamplingConfig(temperature=TEMPERATURE),
        epochs=epochs,
        layout=layout,
        seed=0,
        programs=programs.Programs(mesh),
        **kw,
    )


@functools.partial(jax.jit, static_argnums=0)
def _reference_logp(graphdef, params, tokens_NL, attn_NL):
    """Logprobs of every completion token from a full-length forward pass of each row."""
    positions = decoder.positions_from_mask(attn_NL)
    logits, _ = decoder.forward(graphdef, params, tokens_NL, positions, attn_NL)
    logits = transform_logits(logits[:, P - 1 : -1], SamplingConfig(temperature=TEMPERATURE))
    logp = jax.nn.log_softmax(logits)
    return jnp.take_along_axis(logp, tokens_NL[:, P:, None], axis=-1)[..., 0]


def _rollouts(graphdef, params, vocab, *, longest=9, seed=0):
    """Left-padded prompts of 2-6 tokens, completions of 1-`longest` tokens (padding after),
    a few tokens out of the loss (forced) and one filtered group (no trained tokens); the
    generator's logprobs are the trainer's plus noise."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, vocab, (N, P + M)).astype(np.int32)
    prompt = rng.integers(2, P + 1, N)
    completion = rng.integers(1, longest + 1, N)
    completion[0] = longest
    attn = np.concatenate(
        [np.arange(P)[None] >= P - prompt[:, None], np.arange(M)[None] < completion[:, None]], 1
    )
    tokens[~attn] = 0
    mask = attn[:, P:] & (rng.random((N, M)) > 0.1)
    mask[2 * G : 3 * G] = False  # A filtered group.
    logp = np.asarray(_reference_logp(graphdef, params, tokens, attn))
    noise = rng.normal(0, 0.3, (N, M)).astype(np.float32)
    return types.SimpleNamespace(
        tokens_NL=tokens,
        attn_mask_NL=attn,
        mask_NM=mask,
        reward_N=rng.integers(0, 2, N).astype(np.float32),
        correct_N=np.zeros(N, bool),
        row_weight_N=np.ones(N, np.float32),
        sampler_logp_NM=np.where(attn[:, P:], logp + noise, 0.0).astype(np.float32),
        prompt_len=P,
    ), noise


def _update(learn, params, value_params, roll, ref_params=None):
    state = learn.init(params, value_params)
    state, mets, _ = learn.update(state, ref_params, roll, step=1)
    return jax.tree.map(np.asarray, (state.params, mets))


@functools.partial(jit_without_ynn, static_argnums=0)
def _logp_jacobian(graphdef, params, tokens_NL, attn_NL):
    """d logp[n, t] / d params of `_reference_logp`, [N, M, *shape]: row by row, as row n's
    logprobs depend on its own tokens alone (`jax.jacrev` of the whole batch's logprobs at
    once does N times the work, a backward pass over every row per token). Compiled without
    the YNNPACK fusions that jaxlib 0.10.2 miscompiles in vmapped backward passes
    (`conftest.jit_without_ynn`)."""

    def row(tokens_L, attn_L):  # [M, *shape]
        logp = lambda p: _reference_logp(graphdef, p, tokens_L[None], attn_L[None])[0]  # noqa: E731
        return jax.jacrev(logp)(params)

    return jax.vmap(row)(tokens_NL, attn_NL)


@functools.partial(jit_without_ynn, static_argnums=(0, 1, 2))
def _oracle_step(
    graphdef, loss_stage, mode, params, jac_logp, tokens_NL, attn_NL, terms, rows, update
):
    """One optimizer step of `_oracle` on `rows`: ((loss sum, (denominator, the sum's terms'
    magnitudes)), gradients), and for each parameter the largest sum, over its entries, of
    the magnitudes of an entry's per-token contributions (`_param_rounding`), from the
    rows' `_logp_jacobian` `jac_logp`. Compiled as `_logp_jacobian` is: the loss's Jacobian
    in logp is a vmapped backward pass too."""
    tokens, attn = tokens_NL[rows], attn_NL[rows]
    mb = {k: v[rows] for k, v in terms.items()}
    aggregate = objectives.aggregate(mode, group_size=G, max_len=M)

    def loss_sum(x):  # d loss_sum / d per-token loss: the aggregation's weights.
        return aggregate.update({"loss": x, "mask": mb["mask"]}, None)[0]["loss_sum"]

    coefficients = jax.grad(loss_sum)(jnp.zeros(mb["mask"].shape))

    def from_logp(logp):
        out, _ = loss_stage.update({**mb, "logp": logp, "update": update}, loss_stage.init())
        return out

    def loss_fn(p):
        logp = _reference_logp(graphdef, p, tokens, attn)
        out = from_logp(logp)
        loss = coefficients * out["loss"]
        # The sum's terms' magnitudes, alone and weighted by (1 + |logp|).
        magnitude = [jnp.sum(jnp.abs(w * loss)) for w in (1.0, 1.0 + jnp.abs(logp))]
        return out["loss_sum"], (out["denominator"], magnitude)

    # Each parameter's gradient sums per-token contributions, coefficients x loss: their
    # Jacobian, by the chain rule through logp.
    logp = _reference_logp(graphdef, params, tokens, attn)
    jac_RMRM = jax.jacrev(lambda x: coefficients * from_logp(x)["loss"])(logp)

    def largest(j):
        contributions = jnp.einsum("abcd,cd...->ab...", jac_RMRM, j)
        return jnp.max(jnp.sum(jnp.abs(contributions), axis=(0, 1)))

    mag = jax.tree.map(largest, jac_logp)
    return jax.value_and_grad(loss_fn, has_aux=True)(params), mag


def _oracle(learn, params, roll, ref_params=None, mode="prompt_mean"):
    """The update as a plain loop over full-length rows, one row per sequence and no packing:
    `ref_logp` from the reference's full-length forward pass where the chain reads it, the
    batch stage on the whole batch, then per optimizer step (`Learner.step_rows`) one
    `jax.grad` of its rows' loss sum, divided by its denominator, and an SGD step
    (`_oracle_step`). Returns the params, each step's loss sum and how far another
    computation of it may round (`_loss_rounding`), and how far each parameter may
    (`_param_rounding`, from the logprobs' `_logp_jacobian`: the same program for every
    chain). `mode`: the chain's aggregation."""
    objective = learn.objective
    tokens, attn = jnp.asarray(roll.tokens_NL), jnp.asarray(roll.attn_mask_NL)
    host = {
        "mask": roll.mask_NM,
        "reward": roll.reward_N,
        "correct": roll.correct_N,
        "row_weight": roll.row_weight_N,
        "sampler_logp": roll.sampler_logp_NM,
    }
    if "ref_logp" in objective.model_terms:
        host["ref_logp"] = _reference_logp(learn.graphdef, ref_params, tokens, attn)
    terms, _ = objective.batch.update(host, objective.batch.init())
    terms.pop("metrics", None)
    terms = jax.tree.map(jnp.asarray, terms)
    step = functools.partial(_oracle_step, learn.graphdef, objective.loss, mode)

    out_losses, bounds, param_bounds = [], [], []
    step_rows = learn.step_rows(N, step=1)
    for update, rows in enumerate(step_rows):
        jac = _logp_jacobian(learn.graphdef, params, tokens[rows], attn[rows])
        ((loss, (denom, magnitude)), grads), mag = step(
            params, jac, tokens, attn, terms, rows, update
        )
        scale = LR / max(float(denom), 1.0)
        params = jax.tree.map(lambda p, g, s=scale: p - s * g, params, grads)
        out_losses.append(float(loss))
        bounds.append((update + 1) * _loss_rounding(*map(float, magnitude)))
        param_bounds.append(jax.tree.map(lambda m, s=scale: s * _param_rounding(m), mag))
    # Each step's rounding stays in the params that later steps start from: the bound of the
    # last params counts every step's once per step that follows it, itself included.
    steps = len(step_rows)
    total = jax.tree.map(lambda *b: sum((steps - s) * x for s, x in enumerate(b)), *param_bounds)
    # And each side rounds each step's new params to within half an ulp.
    total = jax.tree.map(lambda t, p: t + steps * 2.0**-23 * jnp.abs(p), total, params)
    return jax.tree.map(np.asarray, (params, total)), out_losses, bounds


def _loss_rounding(terms_sum: float, logp_weighted_sum: float) -> float:
    """How far a step's loss sum under CHAIN may round between two computations (full rows
    here, packed ones in the learner), given the sum of its terms' magnitudes and that sum
    weighted by 1 + |logp|.

    A term is -w A logp / tokens, with w = min(exp(logp - sampler_logp), 4). The two sides
    compute logp through float32 sums of about 1,400 terms in all (per layer about 500: norms,
    projections and the MLP over 64 and 128, attention over at most 18 positions; then the
    head and a logsumexp over the 256-token vocabulary) of magnitudes comparable to logp's
    (logits / T within +-6, logsumexps about 6.5, logp from -9 to -4 here): logp moves by
    `rounding(2^11)` |logp|, w by as much relative, so the term by `rounding(2^11)`
    (1 + |logp|) |term|. Adding the step's at most 8 x 12 terms in another order adds
    `rounding(96)` times their magnitudes. The sum cancels (advantages of both signs): one
    here is 0.11 from terms whose magnitudes add up to 10.5, so its error relative to itself
    is 95 times its terms'."""
    return PER_TOKEN * logp_weighted_sum + rounding(8 * M) * terms_sum


def _param_rounding(contributions, tokens: int = 8 * M):
    """How far a gradient entry may round between two computations, given the largest sum,
    over its parameter's entries, of the magnitudes of an entry's per-token contributions:
    each contribution moves by `PER_TOKEN` of the magnitudes in its logprob's forward pass
    (as in `_loss_rounding`) and as much again in its backward pass, and adding `tokens` of
    them (a step's at most 8 x 12) in another order by `rounding(tokens)`. The backward
    pass's sums mix the cotangents that every entry of a parameter shares (a row of
    hidden-state cotangents feeds a whole row of a weight matrix; an embedding row gets those
    of every position holding its token, themselves sums over the later positions), so an
    entry's rounding follows the magnitudes of its parameter's largest contributions, not of
    its own, which cancellation can make arbitrarily small."""
    return (2 * PER_TOKEN + rounding(tokens)) * contributions


@pytest.fixture(scope="module")
def setup():
    """A two-layer model (quick to compile), its rollouts and their logprob noise."""
    cfg = model.get("tiny", num_layers=2)
    graphdef, _ = model.abstract_model(cfg)
    params = model.init_params(cfg, jax.random.key(0))
    value_params = {"w": jnp.zeros(cfg.d_model), "b": jnp.zeros(())}
    roll, noise = _rollouts(graphdef, params, cfg.vocab_size)
    return graphdef, params, value_params, roll, noise


# (chain, length buckets, pack_length, pack_rows, minibatches, epochs, micro-batches per step).
ORACLE_CASES = {
    # Several sequences per row of 24 tokens, 2 rows per shard: a step's sequences fill 2
    # micro-batches, then 1 (the filtered group left out).
    "packed": (CHAIN, 4, 24, 2, 2, 1, [2, 1]),
    # One sequence per row of P + 9 tokens (trimmed to the 9-token bucket), two epochs.
    "one_per_row": (CHAIN, 4, 0, 0, 2, 2, [1, 1, 1, 1]),
    # A chain reading the reference's ref_logp, 4 rows of 24 tokens per shard, one minibatch
    # in two epochs.
    "ref_logp": (KL_CHAIN, 1, 24, 4, 1, 2, [1, 1]),
    # Micro-batches smaller than a group (`Layout.split_groups`): one row per shard, so each
    # group of 2 on a shard runs over 2 micro-batches; prompt_mean normalizes by the step's
    # group token counts (`aggregate.group_terms`). One sequence per row, then packed rows of
    # 24 tokens for each other aggregation (a row holds 1 to 3 sequences of a group).
    **{
        f"split_{mode}": (
            CHAIN.replace("prompt_mean", mode),
            4,
            0 if mode == "prompt_mean" else 24,
            1,
            2,
            1,
            micro,
        )
        for mode, micro in (
            ("prompt_mean", [4, 4]),
            ("token_mean", [3, 2]),
            ("seq_mean_token_mean", [3, 2]),
            ("seq_sum", [3, 2]),
        )
    },
}


@pytest.mark.slow
@pytest.mark.isa_sensitive
@pytest.mark.parametrize("case", ORACLE_CASES)
def test_packed_update_equals_the_plain_loop(setup, case):
    """The packed update (2 batch shards) gives the parameters of a plain loop over
    full-length rows (`_oracle`), and each optimizer step's loss sum, within their float32
    rounding."""
    graphdef, params, value_params, roll, _ = setup
    chain, buckets, pack, rows, minibatches, epochs, micro = ORACLE_CASES[case]
    mesh = sharding.make_mesh((2, 1, 1))
    learn = _learner(
        mesh,
        graphdef,
        chain,
        buckets=buckets,
        pack=pack,
        pack_rows=rows,
        minibatches=minibatches,
        epochs=epochs,
    )
    ref = jax.tree.map(lambda x: x + 0.01, params)  # Not the policy: the KL term is nonzero.
    mode = chain.rsplit("mode=", 1)[1].rstrip(")")
    (expected, bound), losses, bounds = _oracle(learn, params, roll, ref, mode)
    ref_params = learn.reference(sharding.replicate(ref, mesh)) if learn.spec.ref else None
    got, mets = _update(learn, params, value_params, roll, ref_params)
    assert mets["train/micro_ran"].sum(1).tolist() == micro
    if learn.layout.split_groups:  # Some group's samples did run in different micro-batches.
        placed = roll.mask_NM.any(1)
        plan = batch_layout.plan(
            roll, learn.step_rows(N, 1), learn.layout, shards=2, placed_N=placed
        )
        micro_OBG = plan.place["micro"].reshape(len(micro), -1, G)
        assert np.any(placed.reshape(-1, G).all(1) & (micro_OBG[..., 0] != micro_OBG[..., 1]))
    if learn.spec.ref:
        assert float(np.abs(mets["train/kl"]).max()) > 1e-4
    loss_sum = mets["train/loss_sum"].sum(1)  # Per step: its micro-batches hold other rows.
    assert np.all(np.abs(loss_sum - losses) <= bounds), (loss_sum, losses, bounds)
    for path, a, b, tol in zip(
        jax.tree_util.tree_leaves_with_path(got),
        *map(jax.tree.leaves, (got, expected, bound)),
        strict=False,
    ):
        assert np.all(np.abs(a - b) <= tol), (path[0], np.max(np.abs(a - b) - tol))


@pytest.mark.slow
@pytest.mark.isa_sensitive
def test_packed_logprobs_equal_full_rows(setup):
    """Each completion token's logprob and gradient, from packed rows built on the device
    (several sequences per row, positions restarting per segment; micro-batches of 2 rows of
    24 tokens per batch shard, 2 shards) and from a plain forward pass of each full-length
    row, within their float32 rounding."""
    graphdef, params, value_params, roll, _ = setup
    mesh = sharding.make_mesh((2, 1, 1))
    learn = _learner(mesh, graphdef, buckets=4, pack=24, pack_rows=2)
    rows = np.arange(N).reshape(1, N)
    plan = batch_layout.plan(roll, rows, learn.layout, shards=2, placed_N=roll.mask_NM.any(1))
    Mb = plan.M
    mask = roll.mask_NM[:, :Mb]
    place = {k: v[0] for k, v in plan.place.items()}
    batch = {"tokens": plan.tokens_NL, "attn": plan.attn_NL, "mask": mask}
    spec = learn.spec.forward._replace(pack_length=plan.T, pack_rows=plan.pack_rows)
    tokens, attn = jnp.asarray(roll.tokens_NL), jnp.asarray(roll.attn_mask_NL)

    def logp_full(p):
        logp = _reference_logp(graphdef, p, tokens, attn)[:, :Mb]
        return jnp.where(mask, logp, 0.0)

    def logp_packed(p):
        logp = jnp.zeros(mask.shape)
        for u in range(plan.count[0]):
            f, in_N = forward.packed_micro(spec, batch, place, u)
            t = forward.token_terms(spec, p, value_params, f, ("logp",))
            logp = jnp.where(in_N[:, None], t["logp"], logp)
        return jnp.where(mask, logp, 0.0)

    out = {}
    for name, f in (("full", logp_full), ("packed", logp_packed)):
        out[name] = jax.jit(lambda p, f=f: (f(p), jax.grad(lambda q: jnp.sum(f(q)))(p)))(params)
    assert plan.count[0] == 2 and 2 * 2 * 2 * 24 < N * (P + Mb)  # Fewer tokens, two micro-batches.
    logp = np.asarray(out["full"][0])
    assert np.all(np.abs(out["packed"][0] - logp) <= PER_TOKEN * np.abs(logp))

    # Each gradient entry sums the tokens' contributions in another order.
    def largest(j):  # Over the trained tokens: the others add nothing.
        j = np.asarray(j)[:, :Mb] * mask.reshape(*mask.shape, *[1] * (j.ndim - 2))
        return np.max(np.sum(np.abs(j), axis=(0, 1)))

    mag = jax.tree.map(largest, _logp_jacobian(graphdef, params, tokens, attn))
    for a, b, m in zip(*map(jax.tree.leaves, (out["packed"][1], out["full"][1], mag))):
        tol = _param_rounding(m, int(mask.sum()))
        assert np.all(np.abs(a - b) <= tol), (np.abs(a - b).max(), tol)


@pytest.mark.slow
def test_no_recompile_within_a_bucket(setup, count_compiles):
    """One sequence per row: completions of at most 7 and 8 tokens share the 9-token bucket,
    one program; 2 tokens is another bucket. Packed into 24-token rows (one length bucket),
    the batches fill different numbers of micro-batches, and one has its prompts padded to
    another bucket: one program."""
    graphdef, params, value_params, _, _ = setup
    mesh = sharding.make_mesh((2, 1, 1))
    vocab = int(params["embedding"].shape[0])
    batches = [
        _rollouts(graphdef, params, vocab, longest=n, seed=i)[0] for i, n in enumerate((7, 8, 2))
    ]
    pad = ((0, 0), (2, 0))  # The first batch, its prompts in a 2-token larger bucket.
    wider = types.SimpleNamespace(**vars(batches[0]))
    wider.prompt_len = P + 2
    wider.tokens_NL, wider.attn_mask_NL = (
        np.pad(x, pad) for x in (wider.tokens_NL, wider.attn_mask_NL)
    )
    for pack in (0, 24):
        # One sequence per row: two minibatches, the learner and the programs of
        # `test_ratio_is_against_the_generator_and_match_is_the_first_minibatch`.
        kw = dict(buckets=1, minibatches=1) if pack else dict(buckets=4)
        learn = _learner(mesh, graphdef, pack=pack, **kw)
        state = learn.init(params, value_params)
        micro = []
        for i, roll in enumerate(batches + [wider] * bool(pack)):
            with count_compiles() as c:
                state, mets, ok = learn.update(state, None, roll, step=i + 1)
                jax.block_until_ready(ok)
            if pack:
                micro.append(int(mets["train/micro_ran"].sum()))
                assert i == 0 or c.count == 0
            else:
                assert mets["train/length_bucket"] == (9, 9, 3)[i]
                assert i != 1 or c.count == 0
        names = [e["name"] for e in learn.programs.entries]
        assert names == ["update_step"] * (1 if pack else 2)
    assert len(set(micro)) > 1, micro


@pytest.mark.slow
def test_packed_update_compiles_ahead_from_the_config(setup, count_compiles):
    """With a pack_length and one completion length, the update's shapes follow the config alone: it
    compiles in the background (`precompile`) and the first batch compiles nothing more.
    With several lengths there is nothing to compile ahead."""
    graphdef, params, value_params, roll, _ = setup
    mesh = sharding.make_mesh((2, 1, 1))
    assert not _learner(mesh, graphdef, buckets=4, pack=24).precompile(None, None, N)
    learn = _learner(mesh, graphdef, buckets=1, pack=24)
    state = learn.init(params, value_params)
    assert learn.precompile(state, None, N)
    for future in learn.programs._pending.values():
        future.result()
    with count_compiles() as c:
        jax.block_until_ready(learn.update(state, None, roll, step=1))
    assert c.count == 0 and [e["name"] for e in learn.programs.entries] == ["update_step"]


@pytest.mark.slow
def test_ratio_is_against_the_generator_and_match_is_the_first_minibatch(setup):
    """The generator's logprobs are the trainer's plus noise: the first micro-batch's CISPO
    ratio is exp(-noise), with no old_logp pass, and the logprob match is the noise over the
    first minibatch's tokens (the second minibatch runs after an optimizer step). With
    behaviour=trainer, the old_logp pass runs and reports its gap over the batch."""
    graphdef, params, value_params, roll, noise = setup
    mesh = sharding.make_mesh((2, 1, 1))
    learn = _learner(mesh, graphdef, buckets=4)
    _, mets = _update(learn, params, value_params, roll)
    assert learn.forward_passes == 0 and "train/trainer_logp_gap" not in mets
    mask = roll.mask_NM
    plan = batch_layout.plan(
        roll, learn.step_rows(N, step=1), learn.layout, shards=2, placed_N=mask.any(1)
    )
    first = plan.place["micro"][0] == 0  # The first micro-batch's rows.
    ratio = np.exp(-noise[first])[mask[first]].mean()
    assert float(mets["train/ratio_mean"][0, 0]) == pytest.approx(ratio, rel=1e-4)
    stats = mets["train/logp_match_stats"]
    ran = int(mets["train/micro_ran"][0].sum())
    match = logp_match.logp_match([{k: v[0, u] for k, v in stats.items()} for u in range(ran)])
    rows = plan.place["micro"][0] >= 0  # The first minibatch's trained rows.
    m = mask[rows]
    logp = roll.sampler_logp_NM[rows][m] - noise[rows][m]
    x, y = np.exp(logp), np.exp(roll.sampler_logp_NM[rows][m])
    assert match["train/logp_gap_abs"] == pytest.approx(np.abs(noise[rows][m]).mean(), rel=1e-4)
    assert match["train/prob_pearson"] == pytest.approx(np.corrcoef(x, y)[0, 1], rel=1e-4)

    learn = _learner(
        mesh, graphdef, CHAIN.replace("token_ratio", "token_ratio(behaviour=trainer)"), buckets=4
    )
    _, mets = _update(learn, params, value_params, roll)
    assert learn.forward_passes == 1
    gap = float(mets["train/trainer_logp_gap"])
    assert gap == pytest.approx(np.abs(noise[mask]).mean(), rel=1e-4)


@pytest.mark.parametrize("chunk,shards", [(1, 1), (5, 1), (7, 2), (48, 1)])
def test_chunked_vocab_terms_equal_unchunked(setup, chunk, shards):
    """logp and entropy `chunk` tokens per batch shard at a time (5 and 7 do not divide the
    48 tokens per shard: padded, cut off) give the values and gradients (params and hidden
    states) of all at once."""
    graphdef, params, _, roll, _ = setup
    rng = np.random.default_rng(1)
    D = params["embedding"].shape[1]
    h_nMD = jnp.asarray(rng.normal(size=(4 * shards, M, D)), jnp.float32)
    targets = jnp.asarray(roll.tokens_NL[: 4 * shards, P:])
    logits_cfg = SamplingConfig(temperature=TEMPERATURE)
    weights = jnp.asarray(rng.normal(size=(2, 4 * shards, M)), jnp.float32)

    def loss(p, h, chunk):
        t = forward.vocab_token_terms(
            graphdef, p, h, targets, logits_cfg, ("logp", "entropy"), chunk, shards
        )
        return jnp.sum(weights[0] * t["logp"] + weights[1] * t["entropy"]), t

    grad = jax.jit(jax.grad(loss, argnums=(0, 1), has_aux=True), static_argnums=2)
    want_g, want = grad(params, h_nMD, 0)
    got_g, got = grad(params, h_nMD, chunk)
    for k in ("logp", "entropy"):
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-5, err_msg=k)
    for a, b in zip(jax.tree.leaves(got_g), jax.tree.leaves(want_g)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_chunking_bounds_the_vocabulary_temporaries():
    """The compiled gradient of the vocabulary terms (a 4,096-token vocabulary, 8 completions
    of 256 tokens) holds [n, M, V] float32 buffers when unchunked and only [chunk, V] ones
    when chunked: its temporary memory, read from the compiled program, falls below a
    quarter of one [n, M, V] buffer with 64-token chunks."""
    cfg = model.get("tiny", num_layers=1, vocab_size=4096)
    graphdef, params = model.abstract_model(cfg)
    n, M_long, V, D = 8, 256, cfg.vocab_size, cfg.d_model
    h = jax.ShapeDtypeStruct((n, M_long, D), jnp.float32)
    targets = jax.ShapeDtypeStruct((n, M_long), jnp.int32)

    def temp_bytes(chunk):
        def loss(p, h, t):
            out = forward.vocab_token_terms(
                graphdef, p, h, t, SamplingConfig(), ("logp", "entropy"), chunk
            )
            return jnp.sum(out["logp"] + out["entropy"])

        compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(params, h, targets).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    nMV_bytes = n * M_long * V * 4
    assert temp_bytes(0) >= 2 * nMV_bytes  # Logits and log-probabilities of every token.
    assert temp_bytes(64) < nMV_bytes / 4


@pytest.fixture(scope="module")
def remat_grads(setup):
    """The gradient of the sum of every trained token's logprob, in one micro-batch of every
    row on one device, as a function of the blocks' rematerialization policy; and its value
    without one."""
    graphdef, params, value_params, roll, _ = setup
    mesh = sharding.make_mesh((1, 1, 1))
    learn = _learner(mesh, graphdef, minibatches=1)  # A micro-batch of every row.
    plan = batch_layout.plan(
        roll, np.arange(N).reshape(1, N), learn.layout, shards=1, placed_N=roll.mask_NM.any(1)
    )
    place = {k: v[0] for k, v in plan.place.items()}
    batch = {"tokens": plan.tokens_NL, "attn": plan.attn_NL, "mask": roll.mask_NM}
    spec = learn.spec.forward._replace(pack_length=plan.T, pack_rows=plan.pack_rows)
    assert plan.count[0] == 1

    def logp_sum(p, spec):
        fwd, _ = forward.packed_micro(spec, batch, place, 0)
        logp = forward.token_terms(spec, p, value_params, fwd, ("logp",))["logp"]
        return jnp.sum(jnp.where(roll.mask_NM, logp, 0.0))

    grad = jax.jit(jax.grad(logp_sum), static_argnums=1)
    return lambda remat: grad(params, spec._replace(remat=remat)), grad(params, spec)


@pytest.mark.slow
@pytest.mark.parametrize("remat", ["dots", "full"])
def test_remat_policies_give_the_same_gradients(remat_grads, remat):
    """Rematerialized blocks recompute what the plain backward pass saved: the same logprobs
    and gradients."""
    grad, want = remat_grads
    got = grad(remat)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_remat_bounds_the_compiled_activations(tiny_cfg):
    """The blocks' backward pass keeps less with each policy: compiled temporaries of an
    8-block gradient at 2 x 512 tokens (where the attention scores dominate)."""
    cfg = dataclasses.replace(tiny_cfg, num_layers=8, max_seq_len=512)
    graphdef, params = model.abstract_model(cfg)
    tokens = jnp.zeros((2, 512), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(512), (2, 512))

    def temp(remat):
        def loss(p):
            h = decoder.hidden(graphdef, p, tokens, positions, tokens >= 0, remat=remat)[0]
            return jnp.sum(h**2)

        compiled = jax.jit(jax.grad(loss)).lower(params).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    none, dots, full = temp("none"), temp("dots"), temp("full")
    # One block's attention scores and probabilities: 2 x 4 heads x 512^2 float32, twice.
    block = 2 * 2 * cfg.num_heads * 512 * 512 * 4
    # Measured: none 7.6 blocks' worth (every block's), dots 2.2, full 1.3 (one block's).
    assert none > cfg.num_layers / 2 * block and dots < none / 3 and full < dots < 3 * block
    assert full < 2 * block


@pytest.mark.slow
def test_memory_options_give_the_plain_update(setup):
    """A KL chain with the reference in host memory, chunked logprobs (5 tokens per shard
    at a time) and fully
    rematerialized blocks gives the update of the plain path, and the reference stays in
    pinned host memory."""
    graphdef, params, value_params, roll, _ = setup
    mesh = sharding.make_mesh((2, 1, 1))
    chain = CHAIN.replace(" | aggregate", " | kl_penalty(coef=0.1) | aggregate")
    ref = jax.tree.map(lambda x: x + 0.01, params)  # Not the policy: the KL term is nonzero.
    out = []
    for kw in ({}, dict(offload_ref=True, logprob_chunk=5, remat="full")):
        learn = _learner(mesh, graphdef, chain, buckets=4, **kw)
        ref_params = learn.reference(sharding.replicate(ref, mesh))
        kinds = {x.sharding.memory_kind for x in jax.tree.leaves(ref_params)}
        assert kinds == {"pinned_host" if kw else "device"}
        state, mets, _ = learn.update(learn.init(params, value_params), ref_params, roll, step=1)
        assert float(np.abs(mets["train/kl"]).max()) > 1e-4
        out.append(jax.tree.map(np.asarray, (state.params, mets["train/loss_sum"])))
    for a, b in zip(jax.tree.leaves(out[1]), jax.tree.leaves(out[0])):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_a_buffer_given_twice_is_copied_before_the_donating_update(setup):
    """The update donates its state, and a step given one buffer twice fails; JAX can hand
    out one buffer for two equal leaves (on a GPU, a zero critic bias and its zero Adam
    moment). Here the critic's weights are the final norm's own array: `init` copies it."""
    graphdef, params, value_params, roll, _ = setup
    twice = jax.jit(lambda a, b: (a + 1, b + 1), donate_argnums=(0, 1))
    shared = jnp.ones(3)
    with pytest.raises(Exception, match="donate the same buffer twice"):
        twice(shared, shared)  # The failure this guards against, on this platform too.
    mesh = sharding.make_mesh((1, 1, 1), devices=jax.devices()[:1])
    params = sharding.replicate(params, mesh)  # Placed: `init` keeps the leaves as they are.
    norm = params["final_norm"]["scale"]
    learn = _learner(mesh, graphdef, CHAIN)
    state = learn.init(params, {**value_params, "w": norm})
    leaves = jax.tree.leaves(state)
    buffers = {s.data.unsafe_buffer_pointer() for x in leaves for s in x.addressable_shards}
    assert len(buffers) == len(leaves)
    np.testing.assert_array_equal(state.value_params["w"], norm)
    state, _, ok = learn.update(state, None, roll, step=1)
    assert np.all(np.asarray(ok))


def test_bfloat16_params_keep_float32_master_weights(setup):
    """With bfloat16 params the optimizer keeps float32 masters and moments: the masters
    follow exactly the float32 AdamW run on the same gradients, and the params are the
    masters rounded to bfloat16. The learner's update keeps the dtypes."""
    graphdef, params, value_params, roll, _ = setup
    adam = optax.adamw(1e-2, weight_decay=0.1)
    p32 = {"w": jnp.linspace(-1.0, 1.0, 64).reshape(8, 8)}
    p16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), p32)
    mixed = optim.master_weights(adam)
    state16, ref_state = (
        mixed.init(p16),
        adam.init(jax.tree.map(lambda x: x.astype(jnp.float32), p16)),
    )
    ref = jax.tree.map(lambda x: x.astype(jnp.float32), p16)
    for i in range(5):
        g = {"w": jnp.asarray(np.random.default_rng(i).normal(size=(8, 8)), jnp.bfloat16)}
        u, state16 = mixed.update(g, state16, p16)
        p16 = optax.apply_updates(p16, u)
        u, ref_state = adam.update(jax.tree.map(lambda x: x.astype(jnp.float32), g), ref_state, ref)
        ref = optax.apply_updates(ref, u)
    assert p16["w"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(state16.master["w"], ref["w"])
    np.testing.assert_array_equal(p16["w"], ref["w"].astype(jnp.bfloat16))
    assert {x.dtype for x in jax.tree.leaves(state16.inner) if x.ndim} == {jnp.dtype("float32")}

    mesh = sharding.make_mesh((1, 1, 1))
    bf16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    optimizer = optim.make_optimizer(
        types.SimpleNamespace(
            lr=1e-3,
            warmup_steps=1,
            schedule="constant",
            grad_clip=1.0,
            b1=0.9,
            b2=0.99,
            eps=1e-8,
            weight_decay=0.0,
            decay_steps=1,
            final_lr_frac=0.1,
        ),
        bf16,
    )
    learn = _learner(mesh, graphdef, buckets=4, optimizer=optimizer)
    state, _, ok = learn.update(learn.init(bf16, value_params), None, roll, step=1)
    assert bool(np.all(ok))
    assert {x.dtype for x in jax.tree.leaves(state.params)} == {jnp.dtype("bfloat16")}
    opt = [x.dtype for x in jax.tree.leaves(state.opt_state) if x.ndim]
    assert opt and set(opt) == {jnp.dtype("float32")}
    master = state.opt_state.master[0]
    for p, m in zip(jax.tree.leaves(state.params), jax.tree.leaves(master)):
        np.testing.assert_array_equal(p, m.astype(jnp.bfloat16))
    assert any(
        not np.array_equal(a, b)
        for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(bf16))
    )
