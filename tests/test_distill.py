"""On-policy distillation: `distill_advantage` against hand-computed values, its policy
gradient against the exact gradient of the reverse KL; the teacher's logprobs of a real
sampled batch against a full forward pass (equal to the sampler's when the teacher is the
student), from an rlscale checkpoint as from memory; the bad configs and teachers, each named.
The `:smoke` config runs end to end in `tests/test_rl.py::test_recipe_runs[distill]`."""

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import load_config

from rlscale import checkpoint, config_lib, model, programs, rl, sharding
from rlscale import objectives as obj
from rlscale.objectives import registry
from rlscale.rl import batch_layout, checks, rollouts, setup
from rlscale.rl.teacher import Teacher
from rlscale.sampling import Sampler, SamplingConfig
from rlscale.tokenizers import train_sentencepiece

CHAIN = "distill_advantage | token_ratio | cispo(eps_max=4.0) | aggregate(mode=token_mean)"

# ---- the transform ------------------------------------------------------------------------

# Two rows of 3 tokens, the second one token long: reverse KL log q - log p per token is
# [[0.5, -0.25, 1.0], [2.0, ., .]] on the mask.
MASK = np.array([[1, 1, 1], [1, 0, 0]], bool)
SAMPLER = np.array([[-1.0, -0.5, -2.0], [-0.5, 0.0, 0.0]], np.float32)
TEACHER = np.array([[-1.5, -0.25, -3.0], [-2.5, -9.0, -9.0]], np.float32)  # -9: padding.
VERIFIER = np.array([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]], np.float32)


def _terms(**extra):
    return {
        "mask": jnp.asarray(MASK),
        "sampler_logp": jnp.asarray(SAMPLER),
        "teacher_logp": jnp.asarray(TEACHER),
        **extra,
    }


@pytest.mark.parametrize(
    "coef,mix,expected",
    [
        (1.0, "replace", [[-0.5, 0.25, -1.0], [-2.0, 0.0, 0.0]]),
        (0.5, "replace", [[-0.25, 0.125, -0.5], [-1.0, 0.0, 0.0]]),
        (0.5, "add", [[0.75, 1.125, 0.5], [-2.0, -1.0, -1.0]]),
    ],
)
def test_distill_advantage_hand_values(coef, mix, expected):
    t = obj.distill_advantage(coef=coef, mix=mix)
    out, _ = t.update(_terms(advantage=jnp.asarray(VERIFIER)), t.init())
    np.testing.assert_allclose(out["advantage"], expected, atol=1e-7)
    # Mean reverse KL over the four trained tokens: (0.5 - 0.25 + 1 + 2) / 4.
    np.testing.assert_allclose(out["metrics"]["reverse_kl"], 0.8125, atol=1e-7)


def test_distill_advantage_in_the_registry():
    run = dict(group_size=2, max_len=3)
    assert registry.check(CHAIN, **run) == []
    assert registry.build(CHAIN, **run).model_terms == {"logp", "teacher_logp"}
    add = CHAIN.replace("distill_advantage", "distill_advantage(mix=add)")
    assert registry.check(add, **run) == [
        "objective.chain: distill_advantage needs term 'advantage', which nothing before it "
        "provides (add one of: group_advantages, reinforce_pp_baseline, gae, distill_advantage, "
        "process_advantages)"
    ]
    assert registry.check("group_advantages | " + add, **run) == []
    assert registry.check(CHAIN.replace("distill_advantage", "distill_advantage(mix=sum)"), **run)[
        0
    ].startswith("objective.chain: distill_advantage: mix='sum' is not one of ('replace', 'add')")


def test_policy_gradient_is_the_reverse_kl_gradient():
    """On the student's own samples (ratio 1), the chain's gradient is the per-sample
    estimate mean_i (log q(y_i) - log p(y_i)) grad log q(y_i), exactly; and that estimate
    is unbiased for grad KL(q || p), computed exactly from the two distributions."""
    V, N = 5, 4000
    theta_V = np.array([0.3, -0.2, 1.0, 0.0, -1.0])
    log_q = theta_V - np.log(np.exp(theta_V).sum())
    log_p = np.log(np.array([0.1, 0.2, 0.4, 0.2, 0.1]))
    theta = jnp.asarray(theta_V, jnp.float32)
    y = np.random.default_rng(0).choice(V, N, p=np.exp(log_q))
    objective = obj.build(CHAIN, group_size=1, max_len=1)
    batch = {
        "mask": jnp.ones((N, 1), bool),
        "sampler_logp": jnp.asarray(log_q[y][:, None], jnp.float32),
        "teacher_logp": jnp.asarray(log_p[y][:, None], jnp.float32),
        "update": jnp.asarray(0, jnp.int32),
    }

    def loss(theta):
        logp = jax.nn.log_softmax(theta)[y][:, None]
        out, _ = objective.loss.update({**batch, "logp": logp}, objective.loss.init())
        return out["loss_sum"] / out["denominator"]

    grad = np.asarray(jax.grad(loss)(theta))
    g_NV = (log_q[y] - log_p[y])[:, None] * (np.eye(V)[y] - np.exp(log_q))
    # float32 (the loss) against float64 (the reference), over 4000 samples.
    np.testing.assert_allclose(grad, g_NV.mean(0), atol=1e-5)
    q = np.exp(log_q)
    exact = q * ((log_q - log_p) - np.sum(q * (log_q - log_p)))  # d KL / d theta.
    stderr = g_NV.std(0) / np.sqrt(N)
    assert np.all(np.abs(grad - exact) < 4 * stderr), (grad, exact, stderr)


# ---- the teacher's logprobs of a real sampled batch -----------------------------------------

PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13], [15], [16, 17, 18, 19]]
G, M, TEMPERATURE = 4, 10, 0.7


@pytest.fixture(scope="module")
def tiny():
    """A two-layer model and a 2 x 2 (data x fsdp) mesh: the batch split 4 ways, the
    teacher's params sharded as the learner's."""
    cfg = model.get("tiny", num_layers=2)
    graphdef, _ = model.abstract_model(cfg)
    params = model.init_params(cfg, jax.random.key(0))
    mesh = sharding.make_mesh((2, 2, 1), devices=jax.devices()[:4])
    return cfg, graphdef, params, mesh


def _sample(tiny, **kw) -> rollouts.Rollouts:
    """A batch sampled by the tiny model, as the rollout stage assembles it."""
    cfg, graphdef, params, _ = tiny
    scfg = SamplingConfig(max_new_tokens=M, num_samples=G, stop_tokens=(3, 4), **kw)
    out = Sampler(graphdef, cfg)(params, PROMPTS, jax.random.key(1), scfg)
    prompt, prompt_mask = out.prompt_BP[out.prompt_index], out.prompt_mask_BP[out.prompt_index]
    mask_NM = np.asarray(out.mask)
    N = len(mask_NM)
    return rollouts.Rollouts(
        tokens_NL=np.concatenate([prompt, np.asarray(out.tokens)], 1).astype(np.int32),
        attn_mask_NL=np.concatenate([prompt_mask, mask_NM], 1),
        mask_NM=mask_NM & ~np.asarray(out.forced),
        sampler_logp_NM=np.asarray(out.logprobs, np.float32),
        reward_N=np.zeros(N, np.float32),
        correct_N=np.zeros(N, bool),
        row_weight_N=np.ones(N, np.float32),
        version_NM=np.zeros((N, M), np.int32),
        prompt_len=prompt.shape[1],
    )


def _teacher(tiny, graphdef, params, buckets=2, pack=0):
    mesh = tiny[3]
    params = sharding.reshard(params, sharding.param_shardings(params, mesh, sharding.TRAIN_RULES))
    return Teacher(
        graphdef,
        params,
        model_cfg=tiny[0],
        mesh=mesh,
        temperature=TEMPERATURE,
        layout=batch_layout.Layout(
            pack_length=pack,
            pack_rows=0,
            group_size=G,
            minibatches=2,
            max_len=M,
            length_buckets=buckets,
        ),
        logprob_chunk=1024,
        programs=programs.Programs(mesh),
    )


def _full_forward_logp(graphdef, params, roll):
    """Each completion token's logprob at the temperature, from one full forward pass of
    every row (no plan, no gather, no mesh); 0 past the end."""
    tokens, attn = jnp.asarray(roll.tokens_NL), jnp.asarray(roll.attn_mask_NL)
    logits, _ = model.forward(graphdef, params, tokens, model.positions_from_mask(attn), attn)
    P = roll.prompt_len
    logp = jax.nn.log_softmax(logits[:, P - 1 : -1].astype(jnp.float32) / TEMPERATURE)
    out = jnp.take_along_axis(logp, tokens[:, P:, None], axis=-1)[..., 0]
    return np.where(roll.attn_mask_NL[:, P:], np.asarray(out), 0.0)


def test_teacher_equal_to_the_student_gives_zero_advantage(tiny):
    """The student's own params as the teacher: its logprobs are the sampler's, token for
    token (as the learner's are: README, "The learner"), so the advantage is zero but for
    the sampler's float32 numerics."""
    _, graphdef, params, _ = tiny
    roll = _sample(tiny, temperature=TEMPERATURE)
    teacher_NM = _teacher(tiny, graphdef, params)(roll)
    m = roll.mask_NM
    assert m.sum() > 40 and m[:, : M // 2].sum() < m.sum()  # Both length buckets hold tokens.
    # The cached decode against a forward pass: test_sampler's tolerance for the same pair.
    np.testing.assert_allclose(teacher_NM[m], roll.sampler_logp_NM[m], atol=1e-5)
    assert np.all(teacher_NM[~roll.attn_mask_NL[:, roll.prompt_len :]] == 0.0)
    t = obj.distill_advantage()
    out, _ = t.update(
        {"mask": m, "sampler_logp": roll.sampler_logp_NM, "teacher_logp": teacher_NM}, t.init()
    )
    assert np.max(np.abs(np.asarray(out["advantage"]))) < 1e-5
    assert abs(float(out["metrics"]["reverse_kl"])) < 1e-6  # A mean of signed gaps.


@pytest.mark.slow
@pytest.mark.parametrize("packed", [False, True])
def test_teacher_logprobs_equal_a_full_forward_pass(tiny, packed):
    """Another model as the teacher (a student sampling with top-k): its logprobs equal a
    plain full forward pass at the temperature, without the sampler's top-k, so every
    sampled token has a finite teacher logprob; one sequence per forward row, or two in rows
    of twice the longest. A batch of short completions is trimmed to the first of two length
    buckets, and its logprobs are the same."""
    cfg, graphdef, _, _ = tiny
    other = model.init_params(cfg, jax.random.key(5))
    roll = _sample(tiny, temperature=TEMPERATURE, top_k=20)
    pack = 2 * (roll.prompt_len + M) if packed else 0
    teacher = _teacher(tiny, graphdef, other, buckets=2, pack=pack)
    expected = _full_forward_logp(graphdef, other, roll)
    got = teacher(roll)
    # float32 rounding: a few ulps (the mesh sums its matmuls in another order).
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)
    m = roll.mask_NM
    assert np.all(np.isfinite(got)) and np.abs(got[m] - roll.sampler_logp_NM[m]).mean() > 0.1
    P, cut = roll.prompt_len, M // 2 - 1  # Completions of at most 4 tokens: bucket 5.
    attn = roll.attn_mask_NL.copy()
    attn[:, P + cut :] = False
    short = dataclasses.replace(roll, attn_mask_NL=attn, mask_NM=roll.mask_NM & attn[:, P:])
    got_short = teacher(short)
    np.testing.assert_allclose(
        got_short, np.where(attn[:, P:], expected, 0.0), rtol=1e-6, atol=1e-6
    )
    assert len(teacher.programs.entries) == 2  # One program per length bucket.


def test_teacher_from_an_rlscale_checkpoint(tiny, tmp_path):
    """`setup.make_teacher` loads a params checkpoint (a run's WORKDIR/final) onto the mesh;
    it scores as the same params in memory."""
    cfg, graphdef, _, mesh = tiny
    other = model.init_params(cfg, jax.random.key(5))
    checkpoint.save_params(str(tmp_path / "final"), cfg, other)
    config = load_config("distill", "smoke")
    config.teacher.checkpoint = str(tmp_path / "final")
    config.sampling.temperature, config.sampling.max_new_tokens = TEMPERATURE, M
    config.learner.length_buckets = 2
    progs = programs.Programs(mesh)
    teacher = setup.make_teacher(rl.resolve(config), mesh, None, None, None, progs)
    roll = _sample(tiny, temperature=TEMPERATURE)
    expected = _full_forward_logp(graphdef, other, roll)
    np.testing.assert_allclose(teacher(roll), expected, rtol=1e-6, atol=1e-6)
    assert teacher.model_cfg == cfg  # Its forward passes count at its own size.


# ---- bad configs and teachers -------------------------------------------------------------


def _validate(config) -> str:
    with pytest.raises(ValueError) as e:
        rl.resolve(config)
    return str(e.value)


def test_bad_teacher_configs_are_named(tmp_path):
    config = load_config("distill", "smoke")
    rl.resolve(config)  # "self": no other run needed.
    config.teacher.checkpoint = ""
    assert (
        "objective.chain reads teacher_logp (distill_advantage) but teacher.checkpoint is empty: "
        "set it to the teacher's directory (an rlscale params checkpoint such as a run's "
        "WORKDIR/final, or a Hugging Face model directory), or to 'self' for the policy the run "
        "starts from"
    ) in _validate(config)
    config.teacher.checkpoint = str(tmp_path / "missing")
    config.sampling.temperature = 0.0
    text = _validate(config)  # Every problem at once.
    assert f"teacher.checkpoint='{tmp_path}/missing' does not exist (or is not a directory)" in text
    assert "sampling.temperature=0 (greedy) gives the sampled tokens no logprobs" in text
    config = load_config("distill", "smoke")
    config.teacher.checkpoint = str(tmp_path)
    assert (
        f"teacher.checkpoint='{tmp_path}' holds neither model_config.json (an rlscale params "
        "checkpoint, such as a run's WORKDIR/final or WORKDIR/sft) nor config.json (a Hugging "
        "Face model directory)"
    ) in _validate(config)
    config = load_config("quickstart", "smoke")
    config.teacher.checkpoint = "self"
    assert (
        "teacher.checkpoint='self' is set but objective.chain reads no teacher_logp: add "
        "distill_advantage to the chain, or set teacher.checkpoint='' (no teacher)"
    ) in _validate(config)
    config.objective.chain = "no_such | aggregate(mode=token_mean)"  # Reported once, not twice.
    assert "reads no teacher_logp" not in _validate(config)


CORPUS = [f"{a} + {b} = {a + b}" for a in range(40) for b in range(5)]
OTHER = [f"{a} * {b} is {a * b}" for a in range(40) for b in range(5)]


@pytest.fixture(scope="module")
def tokenizers():
    ours = train_sentencepiece(CORPUS, 275)
    theirs = train_sentencepiece(OTHER, 275)
    assert ours.vocab_size == theirs.vocab_size  # Same size, other tokens: caught id by id.
    return ours, theirs


def _model_dir(path, file, vocab_size):
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, file), "w") as f:
        json.dump({"vocab_size": vocab_size}, f)
    return str(path)


def _teacher_config(path):
    """The teacher and init sections `checks.teacher_problems` reads: the distill smoke
    config's, with `teacher.checkpoint` = `path`."""
    config = load_config("distill", "smoke")
    init = setup.InitConfig(**config.init)
    return setup.TeacherConfig(checkpoint=path), init


def test_a_teacher_with_another_tokenizer_fails_naming_both(tokenizers, tmp_path):
    ours, theirs = tokenizers
    V = ours.vocab_size
    # An rlscale run's workdir: final/ beside the tokenizer.model it was trained with.
    final = _model_dir(tmp_path / "run" / "final", "model_config.json", V)
    with open(tmp_path / "run" / "tokenizer.model", "wb") as f:
        f.write(theirs.serialized)
    (problem,) = checks.teacher_problems(*_teacher_config(final), ours, "w/tokenizer.model")
    token = lambda t, i: t.to_hf().backend.id_to_token(i)  # noqa: E731
    differ = next(i for i in range(V) if token(ours, i) != token(theirs, i))
    assert problem.startswith(
        f"teacher.checkpoint='{final}': the teacher's tokenizer ({tmp_path}/run: {V} ids) is not "
        f"the run's (w/tokenizer.model: {V} ids): "
    )
    assert (
        f"ids differ, e.g. id {differ} is {token(theirs, differ)!r} for the teacher and "
        f"{token(ours, differ)!r} for the run"
    ) in problem
    assert "--config.sft.reuse_from=TEACHER_RUN_WORKDIR" in problem
    with open(tmp_path / "run" / "tokenizer.model", "wb") as f:
        f.write(ours.serialized)
    assert checks.teacher_problems(*_teacher_config(final), ours, "w/tokenizer.model") == []
    # A Hugging Face directory: its own tokenizer.json (the same tokenizer, exported, passes).
    hf_dir = _model_dir(tmp_path / "hf", "config.json", V)
    theirs.to_hf().save(hf_dir)
    (problem,) = checks.teacher_problems(*_teacher_config(hf_dir), ours, "w/tokenizer.model")
    assert f"the teacher's tokenizer ({hf_dir}: {V} ids) is not the run's" in problem
    ours.to_hf().save(hf_dir)
    assert checks.teacher_problems(*_teacher_config(hf_dir), ours, "w/tokenizer.model") == []


def test_a_teacher_without_a_tokenizer_or_with_a_smaller_vocabulary_fails(tokenizers, tmp_path):
    ours, _ = tokenizers
    V = ours.vocab_size
    bare = _model_dir(tmp_path / "bare" / "final", "model_config.json", V - 8)
    assert checks.teacher_problems(*_teacher_config(bare), ours, "w/tokenizer.model") == [
        f"teacher.checkpoint='{bare}' has {V - 8} token ids, fewer than the {V} the policy "
        "samples from: it cannot score every token the student may sample",
        f"teacher.checkpoint='{bare}': no tokenizer (tokenizer.json or tokenizer.model) in "
        f"{bare} or {tmp_path}/bare, so nothing shows that the teacher shares the run's "
        f"tokenizer; copy the tokenizer it was trained with into {bare}",
    ]
    assert checks.teacher_problems(*_teacher_config("self"), ours, "w/tokenizer.model") == []


def test_the_teacher_section_is_a_shared_default():
    assert config_lib.rl_config().teacher.checkpoint == ""
    assert load_config("distill", None).teacher.checkpoint == ""  # Given on the command line.
    assert load_config("distill", "smoke").teacher.checkpoint == "self"
