"""Next-token training tests: the loss against NumPy, learning through the one supervised
step (`supervised.train_step`), and no recompilation."""

import logging
import re

import jax
import jax.numpy as jnp
import numpy as np

from rlscale import model, next_token, optim, supervised


def _setup():
    cfg = model.get("tiny")
    graphdef, _ = model.abstract_model(cfg)
    params = model.init_params(cfg, jax.random.key(0))
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(4, cfg.vocab_size, (4, 16)), jnp.int32)
    mask = jnp.asarray(np.arange(16)[None] < np.array([[16], [12], [9], [5]]))
    return cfg, graphdef, params, tokens, mask


def test_loss_matches_numpy():
    cfg, graphdef, params, tokens, mask = _setup()
    total, count = next_token.loss(graphdef, params, tokens, mask)
    logits, _ = model.forward(graphdef, params, tokens, model.positions_from_mask(mask), mask)
    logits = np.asarray(logits, np.float64)
    expected, n = 0.0, 0
    for b in range(4):
        for t in range(15):
            if mask[b, t] and mask[b, t + 1]:
                row = logits[b, t]
                expected -= (
                    row[tokens[b, t + 1]] - np.log(np.sum(np.exp(row - row.max()))) - (row.max())
                )
                n += 1
    assert int(count) == n == 15 + 11 + 8 + 4
    np.testing.assert_allclose(total, expected, rtol=1e-5)


def test_train_step_learns_and_does_not_recompile(count_compiles):
    cfg, graphdef, params, tokens, mask = _setup()
    fit = supervised.Fit(next_token.batch_loss, graphdef, optim.OptimConfig(lr=3e-3))
    state = supervised.init_state(fit, params)
    batch = next_token.Batch(tokens, mask)
    state, first = supervised.train_step(fit, state, batch)
    with count_compiles() as c:
        for _ in range(30):
            state, metrics = supervised.train_step(fit, state, batch)
        jax.block_until_ready(metrics)
    assert c.count == 0
    assert int(state.step) == 31
    assert float(metrics["loss"]) < 0.5 * float(first["loss"])


def test_fit_calls_back_and_stops_early():
    """`supervised.fit` calls back every `every` steps and at the last, with the mean loss
    since the previous call, and stops where the callback says."""
    cfg, graphdef, params, tokens, mask = _setup()
    fit = supervised.Fit(next_token.batch_loss, graphdef, optim.OptimConfig(lr=3e-3))
    batch = next_token.Batch(tokens, mask)
    seen = []

    def callback(params, progress):
        seen.append(progress)
        return progress.step >= 6

    _, last = supervised.fit(fit, params, lambda: batch, 10, every=3, callback=callback)
    assert [p.step for p in seen] == [3, 6] and last == seen[-1]
    assert int(last.metrics["tokens"]) == 15 + 11 + 8 + 4
    assert seen[1].mean_loss < seen[0].mean_loss


def test_fit_shows_progress_between_callbacks():
    """With a label, a line every max(every // 6, 25) steps that is not a callback's, with
    the mean loss since the last line, the elapsed time and the ETA; none without. (Read
    from absl's logger directly: a test before may have set up the console's handlers.)"""
    cfg, graphdef, params, tokens, mask = _setup()
    fit = supervised.Fit(next_token.batch_loss, graphdef, optim.OptimConfig(lr=3e-3))
    batch = next_token.Batch(tokens, mask)
    records, logger = [], logging.getLogger("absl")
    handler, level = logging.Handler(logging.INFO), logger.level
    handler.emit = records.append
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        supervised.fit(
            fit, jax.tree.map(jnp.copy, params), lambda: batch, 60, every=120, label="sft"
        )
        supervised.fit(fit, params, lambda: batch, 30, every=300)  # Donated: the last use.
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    lines = [r.getMessage() for r in records if r.getMessage().startswith("sft step")]
    assert [x.split()[2] for x in lines] == ["25/60", "50/60"]
    assert re.fullmatch(
        r"sft step 25/60 loss \d+\.\d{3} \(\d\d:\d\d elapsed, ETA \d\d:\d\d\)", lines[0]
    )
