"""Router replay (docs/model_and_sampling.md#router-replay): the generator records the experts
of every prompt and sampled token of a mixture-of-experts policy, they follow the learner's
packing, and the learner's forward passes can replay them. With replay a float32 generator's
logprobs are the trainer's to float32 rounding; a bfloat16 generator's router chooses other
experts than the float32 trainer's, and replay removes that part of the gap. Bad settings
fail at start-up naming the key, and the `:moe` quickstart runs end to end."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import load_config, metric_lines, rounding

from rlscale import model, rl, sharding
from rlscale.model import decoder
from rlscale.rl import batch_layout, forward
from rlscale.rl.rollouts import Rollouts
from rlscale.sampling import Sampler, SamplingConfig, precision
from rlscale.sampling.generator import Generator, Request

CFG = model.get("tiny_moe")
SCFG = SamplingConfig(max_new_tokens=32, num_samples=2, buckets=(16,))
# 12 prompts x 2 samples x 32 tokens: enough slots (3072) that a bfloat16 generator's router
# flips some (measured: 0.6% of them) on any machine.
_rng = np.random.default_rng(0)
PROMPTS = [list(_rng.integers(4, CFG.vocab_size, n)) for n in (5, 9, 16, 3) * 3]
# The float32 reductions a logprob of tiny_moe comes through, per block: the attention's
# RMSNorm, the q/k/v projections, the q and k norms, the attention scores, softmax and its
# values, the output projection, the MLP's RMSNorm, the router's logits, its softmax, the
# top-k renormalisation, the experts' gate/up and down projections and their mixture (15);
# then the final norm, the LM head and the log-sum-exp: 2 x 15 + 3. Each has at most 256
# terms (the vocabulary; d_model 64, expert width 32, at most 48 positions).
REDUCTIONS, TERMS = 33, 256
# One jit for the four rescorings (two programs: with and without replay), traced once each.
_no_grad_terms = jax.jit(forward.no_grad_terms, static_argnums=(0, 6))


def _sample(params, dtype: str) -> Rollouts:
    """The generator engine's completions of `PROMPTS` (the generator in `dtype`, as
    `sampling.generator_dtype`), as a learner batch: prompts left-padded to 16 tokens, the
    sampler's logprobs and its recorded routing (`experts_NLlc`)."""
    gen_cfg = precision.generator_model(CFG, dtype)
    gen_graphdef = model.abstract_model(gen_cfg)[0]
    gen_params = params if gen_cfg is CFG else precision.cast_params(params, dtype=dtype)
    gen = Generator(gen_graphdef, gen_cfg, SCFG, slots=8, max_prompt_len=16)  # Slots reused.
    gen.set_params(gen_params, 0)
    gen.submit(
        [Request(i, p, jax.random.fold_in(jax.random.key(1), i)) for i, p in enumerate(PROMPTS)]
    )
    done = {}
    while len(done) < len(PROMPTS):
        done.update((c.request.id, c) for c in gen.step(8).completed)
    done = [done[i] for i in range(len(PROMPTS))]
    G, P = SCFG.num_samples, 16
    prompt = np.zeros((len(PROMPTS), P), np.int32)
    for i, p in enumerate(PROMPTS):
        prompt[i, P - len(p) :] = p
    prompt_NP = np.repeat(prompt, G, 0)
    mask_NM = np.concatenate([c.mask_GM for c in done])
    N = len(mask_NM)
    return Rollouts(
        tokens_NL=np.concatenate([prompt_NP, np.concatenate([c.tokens_GM for c in done])], 1),
        attn_mask_NL=np.concatenate([prompt_NP > 0, mask_NM], 1),
        mask_NM=mask_NM,
        sampler_logp_NM=np.concatenate([c.logprobs_GM for c in done]),
        reward_N=np.zeros(N, np.float32),
        correct_N=np.zeros(N, bool),
        row_weight_N=np.ones(N, np.float32),
        version_NM=np.zeros(mask_NM.shape, np.int32),
        prompt_len=P,
        experts_NLlc=np.concatenate([c.experts_GLlc for c in done]),
    )


def _rescore(params, roll: Rollouts, replay: bool) -> dict:
    """The float32 trainer's `logp` and `routing_mismatch` of the batch, [N, M], through the
    learner's own path: packed (two sequences to a row of 96 tokens, 2 rows per batch shard
    of 2), the recorded routing scattered with the tokens (`forward.packed_micro`), each
    token routed by its recorded experts with `replay`, else by the trainer's own router."""
    mesh = sharding.make_mesh((2, 1, 1))
    layout = batch_layout.Layout(96, 2, SCFG.num_samples, 1, SCFG.max_new_tokens, 1)
    N = len(roll.mask_NM)
    plan = batch_layout.plan(
        roll, np.arange(N)[None], layout, shards=2, placed_N=roll.mask_NM.any(1)
    )
    spec = decoder.ForwardSpec(
        graphdef=model.abstract_model(CFG)[0],
        mesh=mesh,
        logits_cfg=SCFG,
        pack_length=plan.T,
        pack_rows=plan.pack_rows,
        router_replay=replay,
    )
    host = {"tokens": plan.tokens_NL, "attn": plan.attn_NL, "mask": roll.mask_NM[:, : plan.M]}
    batch = sharding.put_batch({**host, "experts": plan.experts_NLlc}, mesh, sharding.TRAIN_RULES)
    place = sharding.put_batch(plan.place, mesh, sharding.TRAIN_RULES, axis=1)
    terms = ("logp", "routing_mismatch")
    out = _no_grad_terms(spec, params, None, batch, place, jnp.asarray(plan.count), terms)
    return {k: np.asarray(v) for k, v in out.items()}


@pytest.fixture(scope="module")
def runs():
    """One random tiny_moe, sampled with a float32 and a bfloat16 generator, each batch
    rescored by the float32 trainer with and without replay."""
    params = model.init_params(CFG, jax.random.key(0))
    out = {}
    for dtype in ("float32", "bfloat16"):
        roll = _sample(params, dtype)
        out[dtype] = (roll, {r: _rescore(params, roll, r) for r in (True, False)})
    return params, out


@pytest.mark.slow
def test_engine_records_what_the_static_sampler_records(runs):
    """The engine records what the static sampler records for the same request keys (same
    tokens, same experts for every prompt and completion token: both run the same decode
    step), and a dense model records nothing."""
    params, out = runs
    roll, _ = out["float32"]
    graphdef = model.abstract_model(CFG)[0]
    smp = Sampler(graphdef, CFG)(params, PROMPTS, jax.random.key(1), SCFG)
    real_NL = roll.attn_mask_NL.astype(bool)
    np.testing.assert_array_equal(np.asarray(smp.tokens), roll.tokens_NL[:, 16:])
    experts = np.asarray(smp.experts)
    assert experts.shape == roll.experts_NLlc.shape == (24, 48, 2, 2)
    np.testing.assert_array_equal(experts[real_NL], roll.experts_NLlc[real_NL])
    assert np.all(roll.experts_NLlc[real_NL] < CFG.num_experts)
    dense = model.get("tiny")
    gen = Generator(model.abstract_model(dense)[0], dense, SCFG, slots=2, max_prompt_len=16)
    assert gen.state.experts_SClc is None


def test_float32_generator_with_replay_equals_the_trainer_to_rounding(runs):
    """Sync mode, a float32 generator, replay on: the trainer routes every token to the
    experts the generator recorded, so the two compute the same function of the same
    weights, and their logprobs differ only by the order float32 sums add in (the decode
    step's shapes are not the packed forward's): each of the `REDUCTIONS` moves by at most
    `rounding(TERMS)` of its terms' magnitudes, the RMSNorms keep the activations O(1), and
    relative differences add along the chain: |dlogp| <= REDUCTIONS rounding(TERMS) (1 +
    |logp|) for every token (as tests/test_determinism.py argues for a dense model). Replay
    leaves no near-tie of the router to flip. The routing mismatch (the trainer's own top-k
    against the recorded experts) is then that of float32 rounding: near 0."""
    _, out = runs
    roll, rescored = out["float32"]
    mask = roll.mask_NM
    trainer, sampler = rescored[True]["logp"], roll.sampler_logp_NM
    tol = REDUCTIONS * rounding(TERMS) * (1.0 + np.abs(trainer))
    assert mask.sum() > 100
    assert np.all(np.abs(trainer - sampler)[mask] <= tol[mask]), np.max(
        np.abs(trainer - sampler)[mask]
    )
    assert rescored[True]["routing_mismatch"][mask].mean() < 0.01


def test_bfloat16_generator_routes_otherwise_and_replay_closes_that_gap(runs):
    """A bfloat16 generator's router (its logits from bfloat16 activations) chooses other
    experts than the float32 trainer's for some tokens (`routing_mismatch` > 0). Without
    replay such a token mixes other experts' outputs, an O(1) change where the generator's
    rounding moves a logit by a few u (u = 2^-8): the gap grows. With replay the experts
    are the generator's, and what is left is the bfloat16 rounding of the rest of the model
    (attention, the experts' matmuls, the norms), continuous in its inputs as a dense
    model's: the mean gap is in [u / 4, 16 u], the window tests/test_generator_precision.py
    argues for a dense model's bfloat16 generator."""
    _, out = runs
    roll, rescored = out["bfloat16"]
    mask = roll.mask_NM
    u = float(jnp.finfo(jnp.bfloat16).eps) / 2

    def gap(replay):
        return np.abs(rescored[replay]["logp"] - roll.sampler_logp_NM)[mask].mean()

    mismatch = rescored[False]["routing_mismatch"][mask].mean()
    assert mismatch > 0
    assert u / 4 < gap(True) < 16 * u, (gap(True), u)
    assert gap(False) > gap(True), (gap(False), gap(True), mismatch)
    # The float32 generator's gap with replay is of float32's rounding: far below.
    roll32, rescored32 = out["float32"]
    gap32 = np.abs(rescored32[True]["logp"] - roll32.sampler_logp_NM)[roll32.mask_NM].mean()
    assert gap32 < u / 100


def test_replay_settings_fail_at_start_up_naming_the_key():
    """Replay for a dense policy, an unknown mode and replay in a preference run each fail
    in `rl.resolve`, naming the key."""
    dense = load_config("quickstart", "smoke")
    dense.learner.router_replay = "generator"
    with pytest.raises(ValueError, match=r"learner.router_replay='generator'.*dense"):
        rl.resolve(dense)
    dense.learner.router_replay, dense.learner.replay_probe = "off", True
    with pytest.raises(ValueError, match=r"learner.replay_probe=True.*dense"):
        rl.resolve(dense)
    moe = load_config("quickstart", "smoke,moe")
    assert rl.resolve(moe).learner.router_replay == "generator"
    moe.learner.router_replay = "sampler"
    with pytest.raises(ValueError, match=r"learner.router_replay='sampler' is not one of"):
        rl.resolve(moe)


@pytest.mark.slow
def test_moe_quickstart_smoke_run(shared_workdir):
    """`configs/quickstart.py:moe,smoke` end to end, kept cheap: smaller, no SFT (the random MoE
    policy; the warm start of tests/conftest.py is a dense model's) and no zero-variance
    filter (a random policy's groups are all wrong: every step trains, on zero advantages).
    Every step runs the sparse layers with the generator's routing replayed; in sync mode
    with a float32 generator the trained tokens' logprobs match the sampler's to float32
    rounding (tests/test_rl.py's bound for dense recipes) and the routing mismatch is near
    0; the gap without replay (`learner.replay_probe`) is reported beside it."""
    config = load_config("quickstart", "smoke,moe")
    config.sft.max_steps, config.filters.zero_variance = 0, False
    # Two steps of 4 prompts on one device: 27 CPU-s, where the smoke's 3 steps of 8 prompts
    # on the tests' 8 devices took 100 (XLA:CPU runs every expert over every token, and the
    # sharded MoE decoded at 43 tokens/s against one device's 451).
    config.steps, config.batch.prompts, config.eval.prompts = 2, 4, 8
    config.mesh.shape = (1, 1, 1)
    workdir = shared_workdir("moe_smoke", lambda w: rl.run(rl.resolve(config), str(w)))
    train = metric_lines(workdir)[1:]
    assert len(train) == config.steps
    for x in train:
        assert x["train/logp_gap_abs"] < 1e-4
        assert 0 <= x["train/routing_mismatch"] < 0.01
        assert x["train/logp_gap_abs_without_replay"] >= 0
        assert np.isfinite(x["train/moe_lb"])
    summary = json.load(open(workdir / "summary.json"))
    assert 0 <= summary["end/eval_pass@1"] <= 1


@pytest.mark.slow
def test_multi_turn_replies_and_weight_swaps_are_recorded(runs):
    """Episodes with turns: the routing of the environment's replies (prefilled by
    `engine.extend`) and of tokens run again under new weights (`engine.refresh`, here the
    same values as version 1) is recorded at their columns too. Every real token's recorded
    experts are those of one float32 forward pass over the whole row, but for the rare
    (layer, choice) slot whose router margin float32 rounding can flip between the decode
    step's shapes and the full pass's (none in 768 tokens above): at most 1% of them."""
    params, out = runs
    roll, _ = out["float32"]
    counts = np.bincount(roll.tokens_NL[:, 16:][roll.mask_NM], minlength=CFG.vocab_size)
    stops = tuple((int(t),) for t in np.argsort(counts)[-4:])  # Frequent: several turns.
    scfg = SamplingConfig(max_new_tokens=32, num_samples=2, buckets=(8, 16), action_stops=stops)
    graphdef = model.abstract_model(CFG)[0]
    gen = Generator(graphdef, CFG, scfg, slots=4, max_prompt_len=16)
    gen.set_params(params, 0)
    gen.submit(
        [Request(i, p, jax.random.fold_in(jax.random.key(1), i)) for i, p in enumerate(PROMPTS[:4])]
    )
    done, replies = [], 0
    while gen.busy:
        stepped = gen.step(4)
        done += stepped.completed
        for turn in stepped.waiting:
            replies += 1
            gen.reply(turn.handle, [5 + turn.sample, 7, 9][: 1 + replies % 3])
        if replies and gen.version == 0:
            gen.set_params(params, 1)
    assert replies >= 4 and gen.stats.env_tokens > 0
    done = sorted(done, key=lambda c: c.request.id)
    P = 16
    rows, masks, ids = [], [], []
    for c in done:
        p, L = c.request.prompt, P + scfg.max_new_tokens
        assert c.experts_GLlc.shape[1] == scfg.bucket(len(p)) + scfg.max_new_tokens
        for g in range(scfg.num_samples):
            row = np.zeros(L, np.int32)
            row[P - len(p) : P], row[P:] = p, c.tokens_GM[g]
            rows.append(row)
            masks.append(np.concatenate([np.arange(P) >= P - len(p), c.mask_GM[g]]))
            width = ((L - c.experts_GLlc.shape[1], 0), (0, 0), (0, 0))  # Left-padded to P.
            ids.append(np.pad(c.experts_GLlc[g], width))
    tokens, mask = np.stack(rows), np.stack(masks)
    env = np.concatenate(
        [np.zeros((len(rows), P), bool), np.concatenate([c.env_GM for c in done])], 1
    )
    assert env.sum() > 0
    _, _, routing = jax.jit(decoder.routed_hidden, static_argnums=0)(
        graphdef, params, tokens, decoder.positions_from_mask(mask), mask
    )
    own = np.moveaxis(np.asarray(routing.expert_ids_lBTc), 0, 2)
    same = np.all(np.sort(own, -1) == np.sort(np.stack(ids), -1), -1)  # [N, L, l]
    assert same[mask].mean() >= 0.99 and same[env].mean() >= 0.99, same[mask].mean()
