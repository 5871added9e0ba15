"""The learner's update, against an independent re-derivation: real tokens only (trimmed,
bucketed, packed) give the loss and gradients of full-length rows, the one compiled update
equals a per-micro-batch loop, no recompile within a bucket, the ratio reads the generator's
logprobs. Memory at real sizes: chunked logprobs and entropy, rematerialized blocks and a
host-offloaded reference give the plain path's values and gradients; bfloat16 params keep
float32 master weights and optimizer state."""

import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import rounding

from rlscale import model, objectives, optim, programs, sharding
from rlscale.model import decoder
from rlscale.rl import batch_layout, forward, learner, logp_match
from rlscale.sampling import SamplingConfig, transform_logits

G, N, P, M = 2, 16, 6, 12
TEMPERATURE = 0.7
CHAIN = "group_advantages | token_ratio | cispo(eps_max=4.0) | aggregate(mode=prompt_mean)"


def _learner(
    mesh, graphdef, chain=CHAIN, *, buckets=1, pack=0, minibatches=2, micro=2, optimizer=None, **kw
):
    return learner.Learner(
        graphdef=graphdef,
        objective=objectives.build(chain, group_size=G, max_len=M),
        optimizer=optimizer or optax.sgd(0.5),
        mesh=mesh,
        logits_cfg=SamplingConfig(temperature=TEMPERATURE),
        epochs=1,
        minibatches=minibatches,
        micro_batches=micro,
        group_size=G,
        max_len=M,
        length_buckets=buckets,
        pack_length=pack,
        seed=0,
        programs=programs.Programs(mesh),
        **kw,
    )


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


def _update(learn, params, value_params, roll):
    state = learn.init(params, value_params)
    state, mets, _ = learn.update(state, None, roll, step=1)
    return jax.tree.map(np.asarray, (state.params, mets))


def _loop_reference(learn, params, value_params, roll):
    """The update as a plain loop: full-length rows, one `jax.grad` per micro-batch, the
    gradient sums added up and divided once per minibatch, then an SGD step. Returns the
    params, each micro-batch's loss and how far another computation of that loss may round
    away from it (`_loss_rounding`)."""
    objective = learn.objective
    host = {
        "mask": roll.mask_NM,
        "reward": roll.reward_N,
        "correct": roll.correct_N,
        "row_weight": roll.row_weight_N,
        "sampler_logp": roll.sampler_logp_NM,
    }
    terms, _ = objective.batch.update(host, objective.batch.init())
    terms.pop("metrics", None)
    terms = jax.tree.map(jnp.asarray, terms)
    loss_state, losses, bounds = objective.loss.init(), [], []
    aggregate = objectives.aggregate("prompt_mean", group_size=G)

    @jax.jit
    def grad_fn(params, rows):
        def loss_fn(p):
            logp = _reference_logp(learn.graphdef, p, tokens[rows], attn[rows])
            mb = {k: v[rows] for k, v in terms.items()}
            out, _ = objective.loss.update({**mb, "logp": logp, "update": 0}, loss_state)
            # The sum's terms' magnitudes, alone and weighted by (1 + |logp|).
            magnitude = [
                aggregate.update({"loss": w * jnp.abs(out["loss"]), "mask": mb["mask"]}, None)[0]
                for w in (1.0, 1.0 + jnp.abs(logp))
            ]
            return out["loss_sum"], (out["denominator"], [m["loss_sum"] for m in magnitude])

        return jax.value_and_grad(loss_fn, has_aux=True)(params)

    tokens, attn = jnp.asarray(roll.tokens_NL), jnp.asarray(roll.attn_mask_NL)
    for updates, micro_rows in enumerate(learn.micro_rows(N, step=1)):
        grads, denom = None, 0.0
        for rows in micro_rows:
            (loss, (d, magnitude)), g = grad_fn(params, rows)
            grads = g if grads is None else jax.tree.map(jnp.add, grads, g)
            denom += float(d)
            losses.append(float(loss))
            bounds.append((updates + 1) * _loss_rounding(*map(float, magnitude)))
        scale = 0.5 / max(denom, 1.0)
        params = jax.tree.map(lambda p, g, s=scale: p - s * g, params, grads)
    return jax.tree.map(np.asarray, params), losses, bounds


def _loss_rounding(terms_sum: float, logp_weighted_sum: float) -> float:
    """How far a micro-batch's loss sum under CHAIN may round between two computations (full
    rows here, trimmed or packed ones in the learner), given the sum of its terms'
    magnitudes and that sum weighted by 1 + |logp|.

    A term is -w A logp / tokens, with w = min(exp(logp - sampler_logp), 4). The two sides
    compute logp through float32 sums of about 1,400 terms in all (per layer about 500: norms,
    projections and the MLP over 64 and 128, attention over at most 18 positions; then the
    head and a logsumexp over the 256-token vocabulary) of magnitudes comparable to logp's
    (logits / T within +-6, logsumexps about 6.5, logp from -9 to -4 here): logp moves by
    `rounding(2^11)` |logp|, w by as much relative, so the term by `rounding(2^11)`
    (1 + |logp|) |term|. Adding the minibatch's at most 8 x 12 terms in another order adds
    `rounding(96)` times their magnitudes. The sum cancels (advantages of both signs): one
    here is 0.11 from terms whose magnitudes add up to 10.5, so its error relative to itself
    is 95 times its terms' (measured: 3.4e-5 with AVX2 code on an AMD EPYC and 4.7e-5 with
    SSE4.2 code, 6u and 8u of the magnitudes; the bound allows 3.0e-3, two updates' worth)."""
    return rounding(2**11) * logp_weighted_sum + rounding(8 * M) * terms_sum


@pytest.fixture(scope="module")
def setup():
    """A two-layer model (quick to compile), its rollouts and their logprob noise."""
    cfg = model.get("tiny", num_layers=2)
    graphdef, _ = model.abstract_model(cfg)
    params = model.init_params(cfg, jax.random.key(0))
    value_params = {"w": jnp.zeros(cfg.d_model), "b": jnp.zeros(())}
    roll, noise = _rollouts(graphdef, params, cfg.vocab_size)
    return graphdef, params, value_params, roll, noise


@pytest.mark.slow
@pytest.mark.isa_sensitive
def test_real_tokens_give_the_full_length_update(setup):
    """Trimmed to a bucket (12 -> 9 tokens), and also packed into rows of 24 tokens on 2 batch
    shards (the filtered group left out; micro-batches of 2 rows per shard, as many as the
    sequences fill: 2 in the first step, 1 in the second; or of 4 rows: 1 each), the update
    gives the parameters of a per-micro-batch loop over full-length rows, and its losses (per
    micro-batch unpacked, per minibatch packed)."""
    graphdef, params, value_params, roll, _ = setup
    mesh = sharding.make_mesh((2, 1, 1))
    expected, losses, bounds = _loop_reference(_learner(mesh, graphdef), params, value_params, roll)
    # [minibatch, micro-batch]. The second minibatch starts from params that one rounded SGD
    # step has moved: its bounds count two updates' rounding.
    losses, bounds = np.reshape(losses, (2, 2)), np.reshape(bounds, (2, 2))
    for buckets, pack, rows in ((4, 0, 0), (4, 24, 0), (4, 24, 4)):
        learn = _learner(mesh, graphdef, buckets=buckets, pack=pack, pack_rows=rows)
        got, mets = _update(learn, params, value_params, roll)
        loss_sum = mets["train/loss_sum"]
        if pack:  # Per minibatch: packed micro-batches hold other rows.
            assert mets["train/micro_ran"].sum(1).tolist() == ([1, 1] if rows else [2, 1])
            loss_sum, want, bound = loss_sum.sum(1), losses.sum(1), bounds.sum(1)
        else:
            want, bound = losses, bounds
        assert np.all(np.abs(loss_sum - want) <= bound), (buckets, pack, loss_sum, want, bound)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-6, err_msg=f"{buckets=} {pack=}")


@pytest.mark.slow
@pytest.mark.isa_sensitive
def test_packed_logprobs_equal_unpacked(setup):
    """Each completion token's logprob and gradient, from packed rows built on the device
    (several sequences per row, positions restarting per segment; micro-batches of 2 rows of
    24 tokens per batch shard, 2 shards) and from unpacked ones."""
    graphdef, params, value_params, roll, _ = setup
    mesh = sharding.make_mesh((2, 1, 1))
    rows = np.arange(N).reshape(1, N)
    Mb, fwd = batch_layout.plan(roll, rows, max_len=M, buckets=4, shards=2)
    fwd = {k: v[0] for k, v in fwd.items()}
    mask = roll.mask_NM[:, :Mb]
    place, count = batch_layout.pack(
        roll, rows, pack_length=24, pack_rows=2, shards=2, group_size=G
    )
    place = {k: v[0] for k, v in place.items()}
    batch = {
        "tokens": roll.tokens_NL[:, : P + Mb],
        "attn": roll.attn_mask_NL[:, : P + Mb].astype(bool),
        "mask": mask,
    }
    unpacked = _learner(mesh, graphdef, buckets=4).spec.forward
    packed = _learner(mesh, graphdef, buckets=4, pack=24).spec.forward

    def logp_unpacked(p):
        logp = forward.token_terms(
            unpacked, p, value_params, fwd, roll.tokens_NL[:, P : P + Mb], ("logp",)
        )["logp"]
        return jnp.sum(jnp.where(mask, logp, 0.0)), logp

    def logp_packed(p):
        logp = jnp.zeros(mask.shape)
        for u in range(count[0]):
            f, in_N = forward.packed_micro(packed, batch, place, u)
            t = forward.token_terms(packed, p, value_params, f, f["targets"], ("logp",))
            logp = jnp.where(in_N[:, None], t["logp"], logp)
        return jnp.sum(jnp.where(mask, logp, 0.0)), logp

    out = {}
    for name, f in (("unpacked", logp_unpacked), ("packed", logp_packed)):
        grads, logp = jax.jit(jax.grad(f, has_aux=True))(params)
        out[name] = np.where(mask, logp, 0.0), grads
    assert count[0] == 2 and 2 * 2 * 2 * 24 < N * (P + Mb)  # Fewer tokens run, two micro-batches.
    np.testing.assert_allclose(out["packed"][0], out["unpacked"][0], rtol=1e-5, atol=1e-5)
    expected = np.where(
        roll.mask_NM, _reference_logp(graphdef, params, roll.tokens_NL, roll.attn_mask_NL), 0
    )
    np.testing.assert_allclose(out["unpacked"][0], expected[:, :Mb], rtol=1e-5, atol=1e-5)
    for a, b in zip(jax.tree.leaves(out["packed"][1]), jax.tree.leaves(out["unpacked"][1])):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)  # Sums of 100+ terms reordered.


@pytest.mark.slow
def test_no_recompile_within_a_bucket(setup, count_compiles):
    """Completions of at most 7 and 8 tokens share the 9-token bucket: one program; 2 tokens
    is another bucket. Packed (one length bucket), the batches fill different numbers of
    micro-batches, and one has its prompts padded to another bucket: one program."""
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
        learn = _learner(mesh, graphdef, buckets=1 if pack else 4, pack=pack, minibatches=1)
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
    """Packed with one completion length, the update's shapes follow the config alone: it
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
    first = learn.micro_rows(N, step=1)[0]  # The first minibatch's micro-batches.
    mask = roll.mask_NM
    ratio = np.exp(-noise[first[0]])[mask[first[0]]].mean()
    assert float(mets["train/ratio_mean"][0, 0]) == pytest.approx(ratio, rel=1e-4)
    stats = mets["train/logp_match_stats"]
    match = logp_match.logp_match([{k: v[0, u] for k, v in stats.items()} for u in range(2)])
    rows = first.reshape(-1)
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


@pytest.mark.slow
@pytest.mark.parametrize("remat", ["dots", "full"])
def test_remat_policies_give_the_same_gradients(setup, remat):
    """Rematerialized blocks recompute what the plain backward pass saved: the same logprobs
    and gradients."""
    graphdef, params, value_params, roll, _ = setup
    mesh = sharding.make_mesh((1, 1, 1))
    rows = np.arange(N).reshape(1, N)
    Mb, fwd = batch_layout.plan(roll, rows, max_len=M, buckets=1, shards=1)
    fwd = {k: v[0] for k, v in fwd.items()}
    targets = roll.tokens_NL[:, P : P + Mb]
    spec = _learner(mesh, graphdef).spec.forward

    def logp_sum(p, spec):
        logp = forward.token_terms(spec, p, value_params, fwd, targets, ("logp",))["logp"]
        return jnp.sum(jnp.where(roll.mask_NM, logp, 0.0))

    grad = jax.jit(jax.grad(logp_sum), static_argnums=1)
    want = grad(params, spec)
    got = grad(params, spec._replace(remat=remat))
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
