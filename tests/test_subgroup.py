"""Micro-batches smaller than a group (`learner.pack_rows` < `batch.group_size`:
`batch_layout.Layout.split_groups`): where `pack` puts a split group's sequences, that every
aggregation sums over a split group to what it gives over the whole one (prompt_mean through
`aggregate.group_terms`, counted before the micro-batch loop), the start-up rule, the FLOPs
of a shared prefix and the planner's fused-attention stand-in. The
update through a tiny model, split against a plain loop over whole groups, is
tests/test_learner.py's `split_*` oracle cases."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import load_config, rounding

from rlscale import model, objectives, rl
from rlscale.model import attention
from rlscale.objectives.aggregate import MODES, group_terms
from rlscale.planning import flops, fused
from rlscale.rl import batch_layout, report
from rlscale.rl import rollouts as rollouts_lib
from rlscale.scaling import compute

G, B, M = 4, 6, 10  # Samples per group, groups, completion tokens.


def _pack(length_N, pack_rows, *, split, prefix_N=None, one_per_row=False, T=16):
    N = len(length_N)
    return batch_layout.pack(
        np.asarray(length_N),
        np.ones(N, bool),
        np.arange(N)[None],
        pack_length=T,
        pack_rows=pack_rows,
        shards=2,
        group_size=G,
        one_per_row=one_per_row,
        prefix_N=prefix_N,
        split=split,
    )


def test_pack_splits_only_a_group_no_micro_batch_holds():
    """Two shards of 2 groups each, rows of 16 tokens. With room for a group the layout is
    the whole-group one, split or not; with one row per shard (a group of 4 sequences of 9
    to 12 tokens needs 4), each micro-batch holds one sequence per shard: a group runs over
    4 micro-batches, each sequence exactly once, never past its row."""
    rng = np.random.default_rng(0)
    length_N = rng.integers(9, 13, 4 * G)
    for rows, micro in ((G, 2), (2 * G, 1)):  # A shard's 2 groups need 4 rows each.
        whole = _pack(length_N, rows, split=False)
        split = _pack(length_N, rows, split=True)
        assert all(np.array_equal(whole[0][k], split[0][k]) for k in whole[0])
        assert whole[1].tolist() == split[1].tolist() == [micro]
    with pytest.raises(ValueError, match="learner.pack_rows=1 rows of 16 tokens"):
        _pack(length_N, 1, split=False)
    place, count = _pack(length_N, 1, split=True)
    assert count.tolist() == [8]  # 8 sequences per shard, one a micro-batch.
    micro_BG = place["micro"][0].reshape(-1, G)
    assert all(len(set(m)) == G for m in micro_BG.tolist())  # Every group split 4 ways.
    shard_N = np.arange(4 * G) // (2 * G)
    for d in range(2):  # One sequence per shard and micro-batch, in row 0 at offset 0.
        assert sorted(place["micro"][0][shard_N == d].tolist()) == list(range(8))
    assert not place["row"].any() and not place["offset"].any()


def test_a_split_group_writes_its_prefix_in_each_row_it_spans():
    """Shared prefixes (`learner.shared_prefix`): one row of 16 tokens per shard holds a
    6-token prompt's prefix (5 tokens) and 2 samples of 1 + 4 own tokens; a group of 4 is split
    over 2 micro-batches, each row led by one of its samples, which writes the prefix."""
    length_N = np.full(4 * G, 10)
    prefix_N = np.full(4 * G, 5)
    place, count = _pack(length_N, 1, split=True, prefix_N=prefix_N)
    assert count.tolist() == [4]  # 2 groups per shard, 2 micro-batches each.
    lead = place["lead"][0]
    for g in range(4):
        rows = np.arange(g * G, g * G + G)
        micro = place["micro"][0][rows]
        assert sorted(np.bincount(micro).tolist())[-2:] == [2, 2]
        for u in set(micro.tolist()):
            here = rows[micro == u]
            assert len(set(lead[here].tolist())) == 1 and lead[here][0] in here
            assert sorted(place["offset"][0][here].tolist()) == [5, 10]


@pytest.mark.parametrize("mode", MODES)
def test_every_aggregation_sums_a_split_group_to_the_whole(mode):
    """Per-token losses of 6 groups of 4 (a group with no token, rows with none) aggregated
    over micro-batches of whole groups and over micro-batches that split every group (rows
    dealt round-robin into 3): the step's loss, sum(loss_sum) / sum(denominator), and its
    gradient with respect to every per-token loss agree within float32 rounding of sums of
    B G M terms (each side adds them in another order: `rounding`); the denominators exactly.
    Without `group_terms`, prompt_mean's split loss is not the whole one."""
    rng = np.random.default_rng(1)
    loss_NM = jnp.asarray(rng.normal(size=(B * G, M)).astype(np.float32))
    mask_NM = rng.random((B * G, M)) < 0.7
    mask_NM[G : 2 * G] = False  # A group with no token.
    mask_NM[3 * G] = False  # A row with none.
    mask_NM = jnp.asarray(mask_NM)
    agg = objectives.aggregate(mode, group_size=G, max_len=M)
    whole_UN = np.arange(B * G)[None] // G // 2 == np.arange(3)[:, None]  # 2 groups each.
    split_UN = np.arange(B * G)[None] % 3 == np.arange(3)[:, None]  # Every group over 3.

    def step_loss(loss, micro_UN, extra):
        out = [
            agg.update({"loss": loss, "mask": mask_NM * jnp.asarray(u)[:, None], **extra}, None)[0]
            for u in micro_UN
        ]
        total, denom = sum(o["loss_sum"] for o in out), sum(o["denominator"] for o in out)
        return total / denom, denom

    def value_and_grad(micro_UN, extra):
        (loss, denom) = step_loss(loss_NM, micro_UN, extra)
        grad = jax.grad(lambda x: step_loss(x, micro_UN, extra)[0])(loss_NM)
        return float(loss), float(denom), np.asarray(grad)

    terms = group_terms(mask_NM, G)
    whole, split = value_and_grad(whole_UN, {}), value_and_grad(split_UN, terms)
    n = B * G * M
    scale = float(jnp.sum(jnp.abs(loss_NM) * mask_NM)) / whole[1]
    assert split[1] == whole[1]
    assert abs(split[0] - whole[0]) <= 2 * rounding(n) * scale
    assert np.all(np.abs(split[2] - whole[2]) <= 2 * rounding(n) * np.abs(whole[2]))
    assert np.array_equal(split[2] != 0, np.asarray(mask_NM))
    if mode == "prompt_mean":
        assert abs(value_and_grad(split_UN, {})[0] - whole[0]) > 100 * rounding(n) * scale


def test_start_up_refuses_a_mask_narrowed_before_a_split_prompt_mean():
    """Below the group size prompt_mean counts a group's tokens before the loss stage, so a
    loss-stage transform that narrows the mask (high_entropy_tokens) is refused, naming the
    keys; at the group size, or with another aggregation, it is accepted."""
    config = load_config("quickstart", "smoke,entropy_rho=0.2")
    G = config.batch.group_size
    config.learner.pack_rows = G - 1
    with pytest.raises(ValueError) as e:
        rl.resolve(config)
    assert f"learner.pack_rows={G - 1} below batch.group_size={G}" in str(e.value)
    assert "high_entropy_tokens narrows the mask" in str(e.value)
    config.learner.pack_rows = G
    rl.resolve(config)
    config.learner.pack_rows = 1
    config.objective.chain = config.objective.chain.replace("prompt_mean", "token_mean")
    assert rl.resolve(config).learner.pack_rows == 1


def test_flops_count_a_shared_prompt_once():
    """`compute/flops` (`report.Compute`) and the planner's useful work (`flops.model_flops`)
    with `learner.shared_prefix`, against a hand count: 2 groups of 3 samples, prompts of 5
    and 4 real tokens in a 6-token bucket, completions of 2 to 7 tokens. A group's prompt
    runs once (its last token once per sample): 3 x 5 + 3 x 4 + 27 completion tokens, less
    (3 - 1) x 4 and (3 - 1) x 3 shared tokens, = 40; each group fits one row of 32 tokens,
    which the learner's layout fills with exactly those tokens."""
    P, Gs, comp_N = 6, 3, np.array([2, 7, 4, 3, 5, 6])
    prompt_N = np.repeat([5, 4], Gs)
    attn = np.concatenate(
        [np.arange(P) >= P - prompt_N[:, None], np.arange(8) < comp_N[:, None]], axis=1
    )
    tokens = np.where(attn, 1 + np.arange(P + 8) % 7, 0).astype(np.int32)
    tokens[:, P:] += np.arange(6)[:, None]  # Completions differ; a group's prompts do not.
    roll = rollouts_lib.Rollouts(
        tokens_NL=tokens,
        attn_mask_NL=attn,
        mask_NM=attn[:, P:],
        sampler_logp_NM=np.zeros((6, 8), np.float32),
        reward_N=np.zeros(6, np.float32),
        correct_N=np.zeros(6, bool),
        row_weight_N=np.ones(6, np.float32),
        version_NM=np.zeros((6, 8), np.int32),
        prompt_len=P,
    )
    hand = 3 * 5 + 3 * 4 + int(comp_N.sum()) - 2 * 4 - 2 * 3
    assert hand == 40
    layout = batch_layout.Layout(32, 1, Gs, 1, 8, 1, shared_prefix=True)
    assert batch_layout.forward_tokens(roll, layout) == hand
    assert batch_layout.forward_tokens(roll, layout._replace(shared_prefix=False)) == 27 + 27
    plan = batch_layout.plan(roll, np.arange(6)[None], layout, shards=1, placed_N=np.ones(6, bool))
    assert round((1 - plan.padding_frac) * plan.T * plan.pack_rows * int(plan.count.sum())) == hand
    cfg = model.get("tiny")
    counter = report.Compute(max_new_tokens=8, epochs=2, layout=layout)
    counter.add_training(cfg, roll, passes=1)
    want = compute.forward_flops(cfg, hand, P + 4) + 2 * compute.train_flops(cfg, hand, P + 4)
    assert counter.counters["compute/train_flops"] == pytest.approx(want, rel=1e-12)
    # The planner's worst case: 2 prompts of a full 6-token bucket, 3 samples of 8 tokens.
    config = load_config("quickstart")
    config.batch.prompts, config.batch.group_size, config.sampling.max_new_tokens = 2, Gs, 8
    config.learner.shared_prefix = True
    full = rollouts_lib.full_length(6, P, 8)
    useful = flops.model_flops(config, cfg, P)["update"]
    assert batch_layout.forward_tokens(full, layout) == 2 * (P - 1) + 6 * (1 + 8)
    assert useful == pytest.approx(compute.train_flops(cfg, 2 * 5 + 6 * 9, P + 4), rel=1e-12)


def test_fused_standin_is_the_reference_attention_in_a_block_of_memory():
    """`attention='chunked'` (what `--fused_attention` plans) gives the reference
    attention's output and gradients over a packed row (3 segments and padding, grouped
    heads), within float32 rounding of its sums over T keys; its compiled gradient holds
    `STANDIN_COPIES` query blocks' [H, 128, T] float32 arrays where the reference holds
    whole [H, T, T] scores: at T = 1,024, 8 blocks, under a quarter."""
    B, T, H, K, E = 1, 1024, 4, 2, 16
    rng = np.random.default_rng(2)
    q = jnp.asarray(rng.normal(size=(B, T, H, E)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(B, K, E, T)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(B, K, T, E)), jnp.float32)
    seg = jnp.asarray(np.repeat([1, 2, 3, 0], T // 4)[None])
    mask = attention.training_mask(seg > 0, seg)
    w = jnp.asarray(rng.normal(size=(B, T, H, E)), jnp.float32)

    def loss(fn):
        return lambda q, k, v: jnp.sum(fn(q, k, v) * w)

    ref = loss(lambda q, k, v: attention.attention(q, k, v, mask.mask_BTS, 0.25))
    std = loss(lambda q, k, v: attention.apply("chunked", q, k, v, mask, scale=0.25))
    grads = []
    for f in (ref, std):
        g = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)))
        grads.append(g(q, k, v))
        temp = g.lower(q, k, v).compile().memory_analysis().temp_size_in_bytes
        grads[-1] = (*grads[-1], temp)
    (l_r, g_r, temp_r), (l_s, g_s, temp_s) = grads
    tol = 2 * rounding(T)
    assert abs(float(l_r - l_s)) <= tol * float(jnp.sum(jnp.abs(w)) * jnp.abs(v).max())
    for a, b in zip(g_r, g_s):
        assert float(jnp.abs(a - b).max()) <= tol * T * float(jnp.abs(a).max())
    assert temp_s < temp_r / 4
    assert temp_s >= fused.standin_excess_bytes(B, H, T) * 3 // 4
