"""The Bradley-Terry reward model (`rlscale.reward_models.bradley_terry`).

A synthetic preference set with a known reward: the prompt `count D:` names a digit D, the
completion is six digits, and the true reward is how many times D occurs in it; the chosen
completion has more. A 2-layer, 32-wide decoder trained from scratch must order held-out pairs
(> 0.9), including pairs built so that only the prompt decides which side wins (the same
digits, the prompt's digit in the chosen where the other digit is in the rejected). Then the
loss and its gradients against hand values, the score against the decoder's hidden state of
the unpadded row, padding invariance, save/load, the tokenizer check and the command, all on
the model that first test trains (one module fixture).
"""

import functools
import json
import logging
import math
import random
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import random_policy

from rlscale import checkpoint, cli, supervised
from rlscale import tokenizers as tokenizer_lib
from rlscale.data.preferences import Pair
from rlscale.main import train_reward_model
from rlscale.model import config as model_config
from rlscale.model import decoder
from rlscale.reward_models import bradley_terry, scalar_head
from rlscale.tokenizers import chat, train_sentencepiece

DIGITS = "37"
CFG = bradley_terry.RMConfig(seq_len=16, batch_pairs=32, eval_every=40, lr=3e-3)
SHAPE = dict(d_model=32, num_heads=2, num_kv_heads=1, head_dim=16, mlp_dim=64, max_seq_len=32)
STEPS = 80


def _digits(rng, n=6, alphabet="0123456789"):
    return "".join(rng.choice(alphabet) for _ in range(n))


def _pairs(seed: int, n: int, exclude=frozenset()) -> list[Pair]:
    """Chosen = more occurrences of the prompt's digit (no ties); completions in `exclude`
    (the training set's) are skipped, so held-out pairs are unseen."""
    rng, out = random.Random(seed), []
    while len(out) < n:
        d = rng.choice(DIGITS)
        a, b = _digits(rng), _digits(rng)
        if a.count(d) == b.count(d) or a in exclude or b in exclude:
            continue
        out.append(Pair(f"count {d}:", *((a, b) if a.count(d) > b.count(d) else (b, a))))
    return out


def _swapped(seed: int, n: int) -> list[Pair]:
    """Pairs only the prompt decides: the same six digits (no 3 or 7), with k of them set to
    the prompt's digit in the chosen and to the other digit in the rejected."""
    rng, out = random.Random(seed), []
    for _ in range(n):
        d, other = rng.sample(DIGITS, 2)
        chosen = list(_digits(rng, alphabet="0124568"))
        rejected = list(chosen)
        for i in rng.sample(range(6), rng.randint(1, 3)):
            chosen[i], rejected[i] = d, other
        out.append(Pair(f"count {d}:", "".join(chosen), "".join(rejected)))
    return out


TRAIN = _pairs(0, 512)
HELDOUT = _pairs(1, 200, exclude=frozenset(c for p in TRAIN for c in (p.chosen, p.rejected)))


@pytest.fixture(scope="module")
def tok():
    corpus = [p.prompt + p.chosen for p in TRAIN[:100]]
    return train_sentencepiece(corpus, 280, hard_vocab_limit=False)


@pytest.fixture(scope="module")
def policy(tok, tmp_path_factory):
    """A random policy checkpoint that carries its tokenizer."""
    model_cfg = model_config.get("tiny", vocab_size=tok.vocab_size, **SHAPE)
    return random_policy(tmp_path_factory.mktemp("policy"), model_cfg, tok)


@pytest.fixture(scope="module")
def trained(tok, policy):
    return bradley_terry.train(TRAIN, tok, CFG, STEPS, model=str(policy), heldout=HELDOUT)


def _other_tokenizer(text: str, vocab: int):
    return train_sentencepiece([text] * 20, vocab, hard_vocab_limit=False)


@pytest.mark.slow
def test_learns_a_known_reward(trained, tok, policy):
    """Held-out accuracy > 0.9 after 80 steps; > 0.9 as well, from chance at init, on pairs
    that only the prompt's digit decides, so the reward reads the prompt."""
    assert [r.step for r in trained.history] == [40, 80]
    assert trained.history[-1].heldout_accuracy > 0.9
    assert trained.history[-1].loss < trained.history[0].loss < math.log(2)
    held = bradley_terry.encode_pairs(HELDOUT, tok, CFG.seq_len)
    acc = bradley_terry.accuracy(trained.forward, trained.params, held)
    assert acc == trained.history[-1].heldout_accuracy
    swapped = bradley_terry.encode_pairs(_swapped(2, 200), tok, CFG.seq_len)
    assert bradley_terry.accuracy(trained.forward, trained.params, swapped) > 0.9
    # Where `train` began: a random reward orders these prompt-decided pairs by chance (on
    # the held-out pairs, a random reward of digits can be far from 0.5 either way).
    _, graphdef, start = scalar_head.init(str(policy), jax.random.key(CFG.seed))
    assert bradley_terry.accuracy(decoder.ForwardSpec(graphdef), start, swapped) < 0.6
    # `train` centres the head's bias on the training completions.
    train_set = bradley_terry.encode_pairs(TRAIN, tok, CFG.seq_len)
    r_N = bradley_terry.score_rows(
        trained.forward, trained.params, train_set.tokens_NT, train_set.lengths_N
    )
    assert abs(float(np.mean(r_N))) < 1e-4 * float(np.std(r_N))


def test_pair_loss_and_gradient_by_hand():
    r_c = jnp.array([2.0, -1.0, 0.5])
    r_r = jnp.array([1.0, 1.0, 0.5])
    total, n = bradley_terry.pair_loss(r_c, r_r)
    # -log sigmoid(m) = log(1 + e^-m) for the margins m = 1, -2, 0.
    assert n == 3
    np.testing.assert_allclose(total, 0.31326169 + 2.12692801 + 0.69314718, rtol=1e-6)
    g_c, g_r = jax.grad(lambda c, r: bradley_terry.pair_loss(c, r)[0], argnums=(0, 1))(r_c, r_r)
    # d/d r_c = -sigmoid(r_r - r_c): -sigmoid(-1), -sigmoid(2), -sigmoid(0); d/d r_r = -that.
    np.testing.assert_allclose(g_c, [-0.26894142, -0.88079708, -0.5], rtol=1e-6)
    np.testing.assert_allclose(g_r, -g_c, rtol=1e-6)


@functools.partial(jax.jit, static_argnums=0)
def _hidden_last(graphdef, decoder_params, ids_T):
    """The decoder's final hidden state at the last token of one unpadded row."""
    tokens = ids_T[None]
    mask = jnp.ones_like(tokens, bool)
    positions = decoder.positions_from_mask(mask)
    return decoder.hidden(graphdef, decoder_params, tokens, positions, mask)[0][0, -1]


def _reference(graphdef, params, ids):
    h = np.asarray(_hidden_last(graphdef, params["decoder"], jnp.asarray(ids, jnp.int32)))
    return h.astype(np.float64)


def test_score_is_the_head_on_the_last_real_token(trained, tok):
    """score == w . h[last] + b with h from the unpadded row, and whatever follows the last
    real token (other ids in the padding, a longer bucket) changes nothing."""
    g, p = trained.forward, trained.params
    rows = bradley_terry.encode_rows(tok, ["count 3:", "count 7:"], ["337", "123456"])
    batch = bradley_terry.pad_rows(rows, CFG.seq_len, tok.padding_id)
    assert batch.lengths_N.tolist() == [len(r) for r in rows] and len(set(map(len, rows))) == 2
    got = np.asarray(bradley_terry.score(g, p, *batch))
    w, b = np.asarray(p["head"]["w"], np.float64), float(p["head"]["b"])
    want = [_reference(g.graphdef, p, r) @ w + b for r in rows]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    garbage = batch.tokens_NT.copy()
    for i, r in enumerate(rows):
        garbage[i, len(r) :] = np.arange(CFG.seq_len - len(r)) + 5  # Real-looking ids.
    np.testing.assert_array_equal(bradley_terry.score(g, p, garbage, batch.lengths_N), got)
    longer = bradley_terry.pad_rows(rows, 24, tok.padding_id)
    np.testing.assert_allclose(bradley_terry.score(g, p, *longer), got, rtol=1e-6, atol=1e-6)


def test_head_gradient_is_bradley_terry(trained, tok):
    """d mean loss / d w = mean_p -sigmoid(r_r - r_c) (h_c - h_r); d / d b = 0 (b cancels)."""
    g, p = trained.forward, trained.params
    pairs = [Pair("count 3:", "333111", "123456"), Pair("count 7:", "071000", "777000")]
    enc = bradley_terry.encode_pairs(pairs, tok, CFG.seq_len)
    assert len(set(enc.lengths_N.tolist())) == 1  # One shape for `_hidden_last`.

    def loss(params):
        r_N = bradley_terry.rewards(g, params, enc.tokens_NT, enc.lengths_N)
        total, n = bradley_terry.pair_loss(r_N[0::2], r_N[1::2])
        return total / n

    grad = jax.jit(jax.grad(loss))(p)["head"]
    w = np.asarray(p["head"]["w"], np.float64)
    h = [_reference(g.graphdef, p, enc.tokens_NT[i, : enc.lengths_N[i]]) for i in range(4)]
    want = sum(
        -(h[2 * k] - h[2 * k + 1]) / (1 + math.exp((h[2 * k] - h[2 * k + 1]) @ w)) for k in (0, 1)
    )
    np.testing.assert_allclose(grad["w"], want / 2, rtol=1e-4, atol=1e-6)
    assert float(grad["b"]) == 0.0


def test_train_step_freezes_the_lm_head_and_compiles_once(trained, tok, count_compiles):
    params = jax.tree.map(jnp.copy, trained.params)  # `train_step` donates its params.
    lm_head = np.asarray(params["decoder"]["lm_head"][...])
    embedding = np.asarray(params["decoder"]["embedding"][...])
    fit = scalar_head.fit_spec(bradley_terry.loss, trained.graphdef, CFG)
    state = supervised.init_state(fit, params)
    # Adam's two moments for every parameter but the LM head, and two step counts.
    n_params = sum(x.size for x in jax.tree.leaves(params))
    n_state = sum(np.size(x) for x in jax.tree.leaves(state.opt_state))
    assert n_state == 2 * (n_params - lm_head.size) + 2
    enc = bradley_terry.encode_pairs(TRAIN[:32], tok, CFG.seq_len)
    batch = bradley_terry.Batch(enc.tokens_NT, enc.lengths_N)
    with count_compiles() as c:  # `train` compiled it: the same graphdef, config and shapes.
        for _ in range(2):
            state, metrics = supervised.train_step(fit, state, batch)
    params = state.params
    assert c.count == 0
    np.testing.assert_array_equal(params["decoder"]["lm_head"][...], lm_head)
    assert not np.array_equal(params["decoder"]["embedding"][...], embedding)
    assert set(metrics) == {"loss", "accuracy", "margin", "grad_norm"}


def test_save_load_round_trip(trained, tok, tmp_path):
    path = str(tmp_path / "rm")
    bradley_terry.save(path, trained.model_cfg, trained.params, tok, CFG, trained.history)
    loaded = bradley_terry.load(path)
    assert loaded.config == CFG and loaded.model_cfg == trained.model_cfg
    assert scalar_head.fingerprint(loaded.tokenizer) == scalar_head.fingerprint(tok)
    prompts = [p.prompt for p in HELDOUT[:10] for _ in (0, 1)]
    completions = [c for p in HELDOUT[:10] for c in (p.chosen, p.rejected)]
    held = bradley_terry.encode_pairs(HELDOUT[:10], tok, CFG.seq_len)
    want = bradley_terry.score_rows(trained.forward, trained.params, held.tokens_NT, held.lengths_N)
    np.testing.assert_array_equal(loaded.score_texts(prompts, completions), want)
    # Sampled ids, stopped at the EOS or not, score as the texts do.
    prompt_ids = [chat.encode_prompt(tok, p) for p in prompts]
    completion_ids = tok.encode_batch(completions)
    stopped = [c + [tok.eos_id] for c in completion_ids[::2]] + completion_ids[1::2]
    order = [*range(0, 20, 2), *range(1, 20, 2)]
    prompt_ids = [prompt_ids[i] for i in order]
    np.testing.assert_array_equal(loaded.score_completions(prompt_ids, stopped), want[order])
    with open(f"{path}/{bradley_terry.META_FILE}") as f:
        meta = json.load(f)
    assert meta["history"][-1]["heldout_accuracy"] == trained.history[-1].heldout_accuracy
    assert meta["tokenizer"]["sha256"] == scalar_head.fingerprint(tok)
    # The decoder part is a policy checkpoint.
    cfg, _, params = checkpoint.load_params(f"{path}/{scalar_head.DECODER_DIR}")
    assert cfg == trained.model_cfg
    np.testing.assert_array_equal(
        params["embedding"][...], trained.params["decoder"]["embedding"][...]
    )
    n = len(bradley_terry.encode_rows(tok, ["count 3:"], ["1" * 12])[0])  # BOS, 8 + 12 ids, EOS.
    with pytest.raises(ValueError, match=f"row 1 has {n} tokens; rows need 1 to seq_len=16"):
        loaded.score_texts(["count 3:"] * 2, ["1", "1" * 12])


def test_check_tokenizer_names_both(trained, tok, tmp_path):
    path = str(tmp_path / "rm")
    bradley_terry.save(path, trained.model_cfg, trained.params, tok, CFG)
    scalar_head.check_tokenizer(path, tok)
    scalar_head.check_tokenizer(path, tok.to_hf())  # The same ids, as exported with a policy.
    tok.to_hf().save(str(tmp_path / "hf"))
    scalar_head.check_tokenizer(path, str(tmp_path / "hf"))
    other = _other_tokenizer("hello world, the policy's words", 290)
    with pytest.raises(ValueError) as e:
        scalar_head.check_tokenizer(path, other)
    msg = str(e.value)
    assert msg.startswith(
        f"tokenizer mismatch: the reward model {path}'s tokenizer (SentencePieceTokenizer, "
        f"vocab {tok.vocab_size}, sha256 {scalar_head.fingerprint(tok)[:12]}) is not the policy's "
        f"tokenizer (SentencePieceTokenizer, vocab {other.vocab_size}, "
        f"sha256 {scalar_head.fingerprint(other)[:12]})"
    )
    assert str(tok.encode(scalar_head._PROBE)[:12]) in msg
    hf_dir = str(tmp_path / "other_hf")
    other.to_hf().save(hf_dir)
    with pytest.raises(ValueError, match=f"is not the policy's tokenizer {hf_dir} \\(HFTokenizer"):
        scalar_head.check_tokenizer(path, hf_dir)

    # Saved again with the Hugging Face form: its files replace tokenizer.model.
    bradley_terry.save(path, trained.model_cfg, trained.params, tok.to_hf(), CFG)
    assert isinstance(bradley_terry.load(path).tokenizer, tokenizer_lib.HFTokenizer)
    scalar_head.check_tokenizer(path, tok)
    with pytest.raises(ValueError, match=f"tokenizer mismatch: the reward model {path}'s"):
        scalar_head.check_tokenizer(path, other)
    # Tokenizer files swapped after saving: `load` refuses them.
    (tmp_path / "rm" / "tokenizer.json").unlink()
    (tmp_path / "rm" / "tokenizer.model").write_bytes(other.serialized)
    with pytest.raises(ValueError, match=f"{path}: the tokenizer files are not the ones saved"):
        bradley_terry.load(path)


def test_config_lists_every_problem():
    with pytest.raises(ValueError) as e:
        bradley_terry.RMConfig(seq_len=0, lr=-1.0, schedule="linear", b2=1.5)
    assert str(e.value) == (
        "Invalid reward model config: seq_len=0 must be >= 1; lr=-1.0 must be > 0; "
        "b2=1.5 must be in [0, 1]; schedule='linear' is not one of ('constant', 'cosine')"
    )


def test_long_pairs_are_dropped_and_said_once(tok, caplog):
    pairs = [Pair("count 3:", "3", "1"), Pair("count 3:", "3" * 20, "1"), Pair("", "3" * 30, "")]
    with caplog.at_level(logging.WARNING, logger="absl"):
        enc = bradley_terry.encode_pairs(pairs, tok, CFG.seq_len)
    assert enc.sources == ["pair 0"] and enc.tokens_NT.shape == (2, CFG.seq_len)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        "dropped 2 of 3 pairs longer than seq_len=16 tokens (the longest has 32): pair 1, pair 2"
    ]
    with pytest.raises(ValueError, match="every pair is longer than seq_len=4"):
        bradley_terry.encode_pairs(pairs, tok, 4)


def _jsonl(path, pairs):
    rows = [{"prompt": p.prompt, "chosen": p.chosen, "rejected": p.rejected} for p in pairs]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def _command(args):
    return cli.call(train_reward_model.define_flags, train_reward_model.main, args)


def test_command(tok, policy, tmp_path, capsys):
    """The CLI from a policy checkpoint that carries its tokenizer (so no --tokenizer), with
    the test's settings: it prints the held-out accuracy it saves; a user's mistake is one
    `error:` line."""
    train_file = _jsonl(tmp_path / "train.jsonl", TRAIN[:64])
    test_file = _jsonl(tmp_path / "test.jsonl", HELDOUT[:50])
    args = ["--pairs", train_file, "--heldout", test_file, "--init", str(policy)]
    args += ["--out", str(tmp_path / "out"), "--steps", "2", "--seq_len", "16"]
    args += ["--batch_pairs", "32", "--eval_every", "40", "--lr", "3e-3"]
    summary = _command(args)
    out, err = capsys.readouterr()
    acc = summary["heldout_accuracy"]
    assert out.splitlines()[0] == f"held-out accuracy {acc:.4f} (50 pairs)"
    assert f"step 2/2  loss {summary['final_loss']:.4f}  held-out accuracy {acc:.3f}" in err
    assert bradley_terry.load(str(tmp_path / "out")).config == CFG

    other_policy = tmp_path / "other_policy"
    shutil.copytree(policy, other_policy)
    (other_policy / "tokenizer.model").write_bytes(_other_tokenizer("other words", 270).serialized)
    args[args.index(str(policy))] = str(other_policy)
    with pytest.raises(SystemExit) as e:
        cli.guard(_command)([*args, "--tokenizer", str(tmp_path / "out")])
    assert e.value.code == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: tokenizer mismatch: the policy checkpoint {other_policy} (")
    with pytest.raises(SystemExit):
        cli.guard(_command)(["--pairs", train_file, "--out", str(tmp_path)])
    assert capsys.readouterr().err == (
        "error: --tokenizer: required unless --init names a policy checkpoint\n"
    )
    with pytest.raises(SystemExit):
        cli.guard(_command)([*args[2:], "--pairs", str(tmp_path / "nope.jsonl")])
    assert capsys.readouterr().err.startswith("error: preference file not found: ")
