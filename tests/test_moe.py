"""Mixture of experts (Qwen3-MoE): logits parity with transformers both ways, expert parallel ==
one device with the work divided, the auxiliary losses against transformers' and by hand,
router replay, and bad input named at start-up."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import HF_TINY, load_config, rounding
from flax import nnx

from rlscale import model, objectives, rl, sharding
from rlscale.model import decoder, hf, moe
from rlscale.planning import hlo

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

_HF = dict(HF_TINY, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2)
# Every layer sparse with renormalised top-k (Qwen3-30B-A3B's settings), and a dense layer
# among sparse ones with the raw top-k probabilities.
CASES = {
    "sparse_norm": dict(norm_topk_prob=True),
    "mixed_raw": dict(norm_topk_prob=False, mlp_only_layers=[1]),
}

_routed = jax.jit(
    decoder.routed_hidden, static_argnums=0, static_argnames=("remat", "mesh", "cache")
)
_logits = jax.jit(decoder.logits, static_argnums=0)


def _hf_model(case, directory):
    config = transformers.Qwen3MoeConfig(**{**_HF, **CASES[case]})
    torch.manual_seed(0)
    m = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():  # Norm scales are ones at init and the router zeros: make them count.
        for name, p in m.named_parameters():
            if "norm" in name or name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.3)
    m.save_pretrained(directory)
    return m


def _tokens(B=2, T=24, vocab=96, seed=0):
    return np.random.default_rng(seed).integers(0, vocab, (B, T))


def _forward(graphdef, params, tokens, expert_ids=None, mesh=None, hidden=False):
    """(logits, routing), and the final hidden states with `hidden`, over unpadded rows."""
    tokens = jnp.asarray(tokens, jnp.int32)
    mask = jnp.ones(tokens.shape, bool)
    h, _, routing = _routed(
        graphdef,
        params,
        tokens,
        model.positions_from_mask(mask),
        mask,
        expert_ids_lBTc=expert_ids,
        mesh=mesh,
    )
    logits = _logits(graphdef, params, h)
    return (logits, routing, h) if hidden else (logits, routing)


def _hf_logits(m, tokens):
    with torch.no_grad():
        out = m(torch.tensor(tokens), output_router_logits=True)
    return out.logits.numpy(), out.router_logits


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers_both_ways(case, tmp_path):
    """transformers' Qwen3-MoE -> rlscale: the same logits; rlscale -> transformers: the
    tensors back bit for bit and transformers computes the same logits. The load-balancing
    loss over the layers equals transformers' `load_balancing_loss_func` on its routers."""
    m = _hf_model(case, tmp_path / "src")
    cfg, graphdef, params = hf.load_hf(str(tmp_path / "src"))
    assert (cfg.num_experts, cfg.experts_per_token, cfg.moe_intermediate_size) == (8, 2, 32)
    assert cfg.moe_layers == ((0,) if case == "mixed_raw" else (0, 1))
    tokens = _tokens()
    ours, routing = _forward(graphdef, params, tokens)
    theirs, router_logits = _hf_logits(m, tokens)
    np.testing.assert_allclose(ours, theirs, atol=1e-4)
    func = transformers.models.qwen3_moe.modeling_qwen3_moe.load_balancing_loss_func
    expected = func(tuple(router_logits), 8, 2).item()
    np.testing.assert_allclose(moe.load_balancing_loss(routing), expected, rtol=1e-5)

    hf.save_hf(str(tmp_path / "out"), cfg, params)
    cfg2, _, params2 = hf.load_hf(str(tmp_path / "out"))
    assert cfg2 == cfg
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(params2)):
        np.testing.assert_array_equal(a, b)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
    assert type(reloaded).__name__ == "Qwen3MoeForCausalLM"
    np.testing.assert_allclose(_hf_logits(reloaded, tokens)[0], theirs, atol=1e-6)


def _moe_logit_bound(cfg, params, h):
    """How far two float32 forwards that add in different orders may differ, per logit
    (tests/test_attention.py's `_logit_bound`, the dense MLP's D + F replaced by the
    router's D, an expert's D + F and the k-term mixture): rounding(N) of the LM head's
    term magnitudes |h| @ |W| (`h` the final hidden states), twice (the differences sit on
    both sides). The expert choice itself must not move: `_router_margin`."""
    T, D = h.shape[1], cfg.d_model
    attn = cfg.head_dim + 3 * T + 2 * D + cfg.num_heads * cfg.head_dim
    layer = attn + 2 * D + cfg.moe_intermediate_size + cfg.experts_per_token
    n = cfg.num_layers * layer + D
    return 2 * rounding(n) * (jnp.abs(h) @ jnp.abs(params["lm_head"][...]))


def _unpadded(tokens):
    mask = jnp.ones(tokens.shape, bool)
    return model.positions_from_mask(mask), mask


@functools.partial(jax.jit, static_argnums=0)
def _router_margin(graphdef, params, tokens):
    """The smallest gap, over tokens and sparse layers, between a token's k-th and (k+1)-th
    router probabilities: the blocks run one by one, each sparse layer's router read on the
    normed input of its MLP."""
    net = nnx.merge(graphdef, params)
    cfg = net.cfg
    positions, mask = _unpadded(tokens)
    attn_mask = decoder.attention_lib.training_mask(mask, None, 0)
    x = jnp.take(net.embedding[...], tokens, axis=0)
    margins = []
    for block in net.layers:
        if block.sparse:
            h = x + block.attn(block.attn_norm(x), positions, attn_mask)[0]
            p = jax.nn.softmax(block.mlp_norm(h) @ block.moe.router[...], axis=-1)
            top = jax.lax.top_k(p, cfg.experts_per_token + 1)[0]
            margins.append(jnp.min(top[..., -2] - top[..., -1]))
        x = block(x, positions, attn_mask, valid_BT=mask)[0]
    return jnp.min(jnp.stack(margins))


@pytest.mark.parametrize("shape", [(1, 1, 1, 8), (2, 1, 1, 4)])
def test_expert_parallel_equals_one_device_and_divides_the_work(shape):
    """Experts sharded over the `expert` axis (one or two per device; the batch over data x
    expert): the logits and the loss (next-token cross-entropy + both auxiliary losses) are
    the one-device ones, within float32 reordering; per device the compiled forward does an
    eighth of the one-device FLOPs (within 5%: the routing's sort and gathers of each expert
    group's tokens are not divided) and holds an eighth of the experts' weights. A batch
    too small for the expert axis (decode-sized, tokens replicated) gives the same values."""
    cfg = model.get("tiny_moe")
    graphdef, _ = model.abstract_model(cfg)
    params = model.init_params(cfg, jax.random.key(0))
    tokens = jnp.asarray(_tokens(8, 12, cfg.vocab_size), jnp.int32)
    assert float(_router_margin(graphdef, params, tokens)) > 4 * rounding(cfg.d_model)
    mesh = sharding.make_mesh(shape)
    placed = sharding.reshard(params, sharding.param_shardings(params, mesh, sharding.TRAIN_RULES))
    gate = placed["layers"][0]["moe"]["gate"][...]
    assert gate.addressable_shards[0].data.shape == (8 // shape[3], 64, 32)
    inputs = (tokens, *_unpadded(tokens))
    on_mesh = jax.device_put(inputs, sharding.batch_sharding(mesh, 2, sharding.TRAIN_RULES))
    run1 = _routed.lower(graphdef, params, *inputs).compile()
    run8 = _routed.lower(graphdef, placed, *on_mesh, mesh=mesh).compile()
    (h1, _, r1), (h8, _, r8) = run1(params, *inputs), run8(placed, *on_mesh)
    np.testing.assert_array_equal(r8.expert_ids_lBTc, r1.expert_ids_lBTc)
    one, eight = _logits(graphdef, params, h1), _logits(graphdef, placed, h8)
    bound = _moe_logit_bound(cfg, params, h1)
    assert np.all(np.abs(np.asarray(eight) - np.asarray(one)) <= bound)
    loss1, loss8 = _loss(one, r1, tokens), _loss(eight, r8, tokens)
    # The cross-entropy moves by at most twice the largest logit bound (a logsumexp and a
    # logit); the auxiliary losses are sums over the 96 tokens of probabilities of D-term
    # logits, every term positive: rounding(96 + D) of their value, twice.
    aux = float(moe.load_balancing_loss(r1) + moe.z_loss(r1))
    tol = 2 * float(jnp.max(bound)) + 2 * rounding(96 + cfg.d_model) * (aux + float(loss1))
    assert abs(float(loss8) - float(loss1)) <= tol

    flops1, flops8 = run1.cost_analysis()["flops"], run8.cost_analysis()["flops"]
    assert flops8 <= 1.05 * flops1 / 8, (flops8, flops1)
    expert_bytes = 2 * 3 * 8 * 64 * 32 * 4  # Two layers of gate, up and down, float32.
    saved = run1.memory_analysis().argument_size_in_bytes - (
        run8.memory_analysis().argument_size_in_bytes
    )
    assert saved >= expert_bytes * (1 - 1 / shape[3])

    if shape[0] == 1:  # 3 tokens on an 8-way axis: replicated, a psum instead.
        small = tokens[:1, :3]
        got, _, h = _forward(graphdef, placed, small, mesh=mesh, hidden=True)
        want, _ = _forward(graphdef, params, small)
        assert np.all(
            np.abs(np.asarray(got) - np.asarray(want)) <= _moe_logit_bound(cfg, params, h)
        )


def _loss(logits, routing, tokens):
    logp = jax.nn.log_softmax(logits[:, :-1])
    ce = -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))
    return ce + moe.load_balancing_loss(routing) + moe.z_loss(routing)


def test_router_replay_reproduces_or_changes_the_logits():
    """Forcing the experts the model chose gives its logits bit for bit (the same program
    shape, the same values); forcing others changes them, with gate weights from the current
    router at the forced ids. Under remat (a scan over the blocks) too."""
    cfg = model.get("tiny_moe")
    graphdef, _ = model.abstract_model(cfg)
    params = model.init_params(cfg, jax.random.key(0))
    tokens = jnp.asarray(_tokens(2, 8, cfg.vocab_size), jnp.int32)
    logits, routing = _forward(graphdef, params, tokens)
    ids = routing.expert_ids_lBTc
    assert ids.shape == (2, 2, 8, 2) and ids.dtype == jnp.int32
    forced, again = _forward(graphdef, params, tokens, expert_ids=ids)
    np.testing.assert_array_equal(forced, logits)
    np.testing.assert_array_equal(again.expert_ids_lBTc, ids)
    other = (ids + 1) % cfg.num_experts  # Still k distinct experts per token.
    moved, r = _forward(graphdef, params, tokens, expert_ids=other)
    np.testing.assert_array_equal(r.expert_ids_lBTc, other)
    assert np.all(np.abs(np.asarray(moved) - np.asarray(logits)).max(axis=-1) > 1e-3)
    h, _, r_remat = _routed(
        graphdef, params, tokens, *_unpadded(tokens), remat="full", expert_ids_lBTc=other
    )
    np.testing.assert_array_equal(r_remat.expert_ids_lBTc, other)
    np.testing.assert_allclose(_logits(graphdef, params, h), moved, atol=1e-5)


def test_auxiliary_losses_by_hand_and_the_moe_aux_transform():
    """Two tokens of one layer over E = 2 experts, k = 1 (one padding token counts nowhere):
    the load-balancing loss E sum_e f_e P_e and the z-loss mean(logsumexp^2) by hand, and
    `moe_aux` adds them to the aggregated loss weighted by its denominator."""
    logits = np.log(np.array([[3.0, 1.0], [1.0, 1.0], [5.0, 7.0]]))  # Row 3: padding.
    p = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)  # [.75 .25], [.5 .5]
    chosen = np.array([[1.0, 0.0], [1.0, 0.0]])  # Both pick expert 0 (a tie goes to the first).
    routing = moe.Routing(
        expert_ids_lBTc=jnp.zeros((1, 1, 2, 1), jnp.int32),
        top_ids_lBTc=jnp.zeros((1, 1, 2, 1), jnp.int32),
        counts_le=jnp.asarray(chosen.sum(0))[None],
        probs_le=jnp.asarray(p[:2].sum(0))[None],
        z_l=jnp.asarray([np.log(4.0) ** 2 + np.log(2.0) ** 2]),
        tokens_l=jnp.asarray([2.0]),
    )
    lb = 2 * (1.0 * 0.625 + 0.0 * 0.375)  # f = (1, 0), P = (0.625, 0.375).
    z = (np.log(4.0) ** 2 + np.log(2.0) ** 2) / 2
    np.testing.assert_allclose(moe.load_balancing_loss(routing), lb, rtol=1e-6)
    np.testing.assert_allclose(moe.z_loss(routing), z, rtol=1e-6)

    # The same sums from the layer itself: a router that gives those logits.
    cfg = model.get("tiny_moe", num_experts=2, experts_per_token=1, d_model=2, num_layers=1)
    layer = moe.MoE(cfg, rngs=nnx.Rngs(0))
    layer.router = layer.router.replace(jnp.eye(2))
    _, r = jax.jit(layer)(
        jnp.asarray(logits[None], jnp.float32), jnp.asarray([[True, True, False]])
    )
    np.testing.assert_allclose(moe.load_balancing_loss(r), lb, rtol=1e-6)
    np.testing.assert_allclose(moe.z_loss(r), z, rtol=1e-6)

    objective = objectives.build(
        "group_advantages | policy_gradient | aggregate(mode=token_mean) | moe_aux(lb=0.01, z=0.1)",
        group_size=2,
        max_len=3,
    )
    terms = {
        "advantage": jnp.ones((2, 3)),
        "logp": jnp.full((2, 3), -1.0),
        "mask": jnp.asarray([[1, 1, 0], [1, 0, 0]], jnp.float32),
        "moe_lb": jnp.float32(lb),
        "moe_z": jnp.float32(z),
    }
    out, _ = objective.loss.update(terms, objective.loss.init())
    assert {"moe_lb", "moe_z"} <= objective.model_terms
    np.testing.assert_allclose(out["denominator"], 3.0)
    np.testing.assert_allclose(out["loss_sum"], 3.0 + 3.0 * (0.01 * lb + 0.1 * z), rtol=1e-6)


def test_bad_moe_settings_fail_naming_the_key():
    with pytest.raises(ValueError, match=r"experts_per_token=9 must be in \[1, num_experts=8\]"):
        model.get("tiny_moe", experts_per_token=9)
    with pytest.raises(ValueError, match="experts_per_token=2 needs num_experts > 0"):
        model.get("tiny", experts_per_token=2)
    with pytest.raises(ValueError, match=r"mlp_only_layers \[5\] are not layers"):
        model.get("tiny_moe", mlp_only_layers=[5])
    cfg = model.get("tiny_moe", num_experts=6)
    mesh = sharding.make_mesh((2, 1, 1, 4))
    with pytest.raises(
        ValueError, match=r"expert axis \(4 devices\) does not divide model.num_experts=6"
    ):
        model.init_sharded(cfg, jax.random.key(0), mesh)
    assert moe.mesh_problems(model.get("tiny"), {"data": 2, "expert": 4}) == [
        "mesh.shape=(2, 4) has an expert axis of 4 but the model has no experts"
    ]
    problems = objectives.check(
        "policy_gradient | moe_aux | aggregate(mode=token_mean)", group_size=2, max_len=3
    )
    assert any("moe_aux" in p and "loss_sum" in p for p in problems), problems
    # A run: the chain's auxiliary losses on a dense model, and an expert axis that does not
    # divide the experts, named before anything is built.
    config = load_config("quickstart")
    config.objective.chain += " | moe_aux(lb=0.001)"
    with pytest.raises(ValueError) as e:
        rl.resolve(config)
    assert "moe_aux needs term 'moe_lb', which this run does not supply: the model has no" in (
        str(e.value)
    )
    config.model.update(num_experts=6, experts_per_token=2, moe_intermediate_size=16)
    config.mesh.shape = (2, 1, 1, 4)
    with pytest.raises(ValueError) as e:
        rl.resolve(config)
    assert "mesh.shape=(2, 1, 1, 4): the expert axis (4 devices) does not divide" in str(e.value)
    assert "moe_aux" not in str(e.value)


def test_dense_forward_has_no_routing_and_the_presets_count():
    """A dense model's routed forward is its forward (no routing outputs); the parameter
    counts of the MoE presets match the initialized pytree (tiny) and the published size
    (Qwen3-30B-A3B: 30.5B total, 3.3B active)."""
    cfg = model.get("tiny")
    graphdef, _ = model.abstract_model(cfg)
    params = model.init_params(cfg, jax.random.key(0))
    tokens = jnp.asarray(_tokens(2, 8, cfg.vocab_size), jnp.int32)
    h, _, routing = _routed(graphdef, params, tokens, *_unpadded(tokens))
    assert routing is None
    tiny = model.get("tiny_moe")
    leaves = jax.tree.leaves(model.abstract_model(tiny)[1])
    assert sum(x.size for x in leaves) == tiny.num_params()
    big = model.get("qwen3_30b_a3b")
    assert round(big.num_params() / 1e9, 1) == 30.5
    assert 3.3e9 <= moe.active_params(big) < 3.4e9


# ------------------------------------------------------------------------------------------
# The all-to-all dispatch (`model.expert_dispatch=all_to_all`).
# ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def a2a_model():
    """tiny_moe's params and 96 tokens (12 per device of an 8-way expert axis), on one
    device and placed on the (1, 1, 1, 8) mesh."""
    cfg = model.get("tiny_moe", expert_dispatch="all_to_all", expert_capacity_factor=4.0)
    graphdef, _ = model.abstract_model(cfg)
    params = model.init_params(cfg, jax.random.key(0))
    tokens = jnp.asarray(_tokens(8, 12, cfg.vocab_size), jnp.int32)
    mesh = sharding.make_mesh((1, 1, 1, 8))
    placed = sharding.reshard(params, sharding.param_shardings(params, mesh, sharding.TRAIN_RULES))
    inputs = (tokens, *_unpadded(tokens))
    on_mesh = jax.device_put(inputs, sharding.batch_sharding(mesh, 2, sharding.TRAIN_RULES))
    return cfg, graphdef, params, placed, mesh, inputs, on_mesh


def test_all_to_all_equals_one_device_and_its_flops_are_the_capacity(a2a_model):
    """Capacity factor e / c = 4 (C = a device's 12 tokens: nothing can drop): the logits
    are the one-device ones within float32 reordering, no choice is dropped, and the
    compiled forward's dispatch exchanges the rows with two all-to-alls per sparse layer
    and gathers no tokens (`planning.hlo`). Its FLOPs are the capacity's: factor 1 (C = 3)
    compiles to 2 layers x e experts x 9 fewer rows x (3 matmuls x 2 D F) fewer, within 2%
    (the activation's few elementwise ops per [C, F] element against the matmuls' 6 D),
    and per device at most an eighth of the one-device forward's."""
    cfg, graphdef, params, placed, mesh, inputs, on_mesh = a2a_model
    run1 = _routed.lower(graphdef, params, *inputs).compile()
    run8 = _routed.lower(graphdef, placed, *on_mesh, mesh=mesh).compile()
    (h1, _, r1), (h8, _, r8) = run1(params, *inputs), run8(placed, *on_mesh)
    np.testing.assert_array_equal(r8.expert_ids_lBTc, r1.expert_ids_lBTc)
    np.testing.assert_array_equal(r8.dropped_l, [0.0, 0.0])
    one, eight = _logits(graphdef, params, h1), _logits(graphdef, placed, h8)
    assert np.all(np.abs(np.asarray(eight) - np.asarray(one)) <= _moe_logit_bound(cfg, params, h1))
    dispatch = hlo.collectives(run8.as_text())["expert_dispatch"]
    assert dispatch["all-to-all"]["count"] == 2 * len(cfg.moe_layers), dispatch
    assert "all-gather" not in dispatch and "reduce-scatter" not in dispatch
    flops1, flops8 = run1.cost_analysis()["flops"], run8.cost_analysis()["flops"]
    assert flops8 <= flops1 / 8

    small = dataclasses.replace(cfg, expert_capacity_factor=1.0)
    assert (moe.capacity(12, cfg), moe.capacity(12, small)) == (12, 3)
    graph_small, _ = model.abstract_model(small)
    run_small = _routed.lower(graph_small, placed, *on_mesh, mesh=mesh).compile()
    fewer = flops8 - run_small.cost_analysis()["flops"]
    expected = len(cfg.moe_layers) * 8 * 9 * 3 * 2 * cfg.d_model * cfg.moe_intermediate_size
    assert fewer == pytest.approx(expected, rel=0.02)


def test_all_to_all_drops_past_capacity_as_counted_by_hand(a2a_model):
    """One layer's experts on the (1, 1, 1, 8) mesh at capacity C = 2 (factor 1, 8 tokens
    x 2 choices per device over 8 experts): the output is the one-device mixture with the
    dropped choices' weights set to 0, the dropped choices found in NumPy (per device, an
    expert's rows past its first C in token then choice order), and the count is theirs over
    the real tokens (the last token of each device is padding)."""
    cfg, _, _, placed, mesh, _, _ = a2a_model
    cfg = dataclasses.replace(cfg, expert_capacity_factor=1.0)
    rng = np.random.default_rng(1)
    X, c, e, n = 64, 2, cfg.num_experts, 8
    ids = np.stack([rng.choice(e, c, replace=False) for _ in range(X)]).astype(np.int32)
    x = rng.normal(size=(X, cfg.d_model)).astype(np.float32)
    w = rng.uniform(size=(X, c)).astype(np.float32)
    valid = np.ones(X, np.float32)
    valid[X // n - 1 :: X // n] = 0
    C = moe.capacity(X // n, cfg)
    assert C == 2
    kept = np.zeros((X, c), bool)
    for d in range(n):
        seen = np.zeros(e, int)
        for t in range(d * X // n, (d + 1) * X // n):
            for j in range(c):
                kept[t, j] = seen[ids[t, j]] < C
                seen[ids[t, j]] += 1
    layer = placed["layers"][0]["moe"]
    weights = [jax.device_put(layer[k][...], jax.devices()[0]) for k in ("gate", "up", "down")]
    want, none = moe.experts(x, ids, np.where(kept, w, 0), valid, *weights, cfg)
    rows = jax.sharding.NamedSharding(mesh, jax.P(sharding.BATCH_AXES))
    experts = jax.sharding.NamedSharding(mesh, jax.P("expert"))
    args = jax.device_put((x, ids, w, valid), rows)
    with jax.set_mesh(mesh):
        got, dropped = jax.jit(moe.experts, static_argnums=7)(
            *args, *jax.device_put(weights, experts), cfg
        )
    assert float(none) == 0.0
    assert float(dropped) == np.sum(~kept * valid[:, None]) > 0
    # Reordered float32 sums of D (gate, up), F (down) and c (mixture) terms: rounding(N) of
    # the terms' magnitudes, |silu(g) u| bounded by 1.1 |x| |W_gate| x |x| |W_up|, twice.
    gate_e, up_e, down_e = (np.abs(np.asarray(a, np.float64)) for a in weights)
    ax = np.abs(x.astype(np.float64))
    h_XcF = np.einsum("xd,xcdf->xcf", ax, 1.1 * gate_e[ids]) * np.einsum(
        "xd,xcdf->xcf", ax, up_e[ids]
    )
    mags = np.einsum("xc,xcf,xcfd->xd", np.where(kept, w, 0), h_XcF, down_e[ids])
    bound = 2 * rounding(cfg.d_model + cfg.moe_intermediate_size + c) * mags
    assert np.all(np.abs(np.asarray(got) - np.asarray(want)) <= bound)


def test_expert_dispatch_settings_fail_naming_the_key():
    names = r"\('all_gather', 'all_to_all'\)"
    with pytest.raises(ValueError, match=f"expert_dispatch='ring' is not one of {names}"):
        model.get("tiny_moe", expert_dispatch="ring")
    with pytest.raises(ValueError, match="expert_capacity_factor=0 must be a number > 0"):
        model.get("tiny_moe", expert_capacity_factor=0)
