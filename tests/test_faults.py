"""Numeric-fault guard: a non-finite step leaves params and optimizer state bit for bit."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from rlscale import faults

TX = optax.adamw(1e-2, weight_decay=0.1)


def apply(grads, state):
    params, opt_state = state
    updates, opt_state = TX.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state


@jax.jit
def guarded_step(state, grads, loss):
    return faults.guarded_update(grads, loss, apply, state)


@jax.jit
def plain_step(state, grads):
    return apply(grads, state)


def bits(tree):
    """Each leaf's raw bytes, so that equality is bit for bit (NaN == NaN, -0.0 != 0.0)."""
    return [np.asarray(x).tobytes() for x in jax.tree.leaves(tree)]


@pytest.fixture(scope="module")
def state():
    """Params and an Adam state after one real step (non-zero moments, count 1)."""
    rng = np.random.default_rng(0)
    params = {
        "w": jnp.asarray(rng.normal(size=(3, 4)), jnp.float32),
        "b": jnp.asarray(rng.normal(size=(4,)), jnp.bfloat16),
    }
    grads = jax.tree.map(lambda x: jnp.full_like(x, 0.3), params)
    return plain_step((params, TX.init(params)), grads)


def grads_like(params, value, seed=1):
    rng = np.random.default_rng(seed)
    grads = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape), x.dtype), params)
    if value is not None:
        grads["w"] = grads["w"].at[1, 2].set(value)
    return grads


@pytest.mark.parametrize(
    "value,loss",
    [(np.nan, 1.0), (np.inf, 1.0), (-np.inf, 1.0), (1e20, 1.0), (None, np.nan), (None, np.inf)],
)
def test_non_finite_step_is_skipped_bit_for_bit(state, value, loss):
    grads = grads_like(state[0], value)
    new_state, ok = guarded_step(state, grads, jnp.float32(loss))
    assert not bool(ok)
    assert bits(new_state) == bits(state)
    assert jax.tree.structure(new_state) == jax.tree.structure(state)


def test_finite_step_equals_plain_update(state):
    grads = grads_like(state[0], None)
    new_state, ok = guarded_step(state, grads, jnp.float32(2.5))
    assert bool(ok)
    assert bits(new_state) == bits(plain_step(state, grads))
    assert bits(new_state) != bits(state)
    assert int(new_state[1][0].count) == 2


def test_global_norm_matches_numpy():
    tree = {"a": jnp.arange(6.0).reshape(2, 3), "b": jnp.asarray([3.0, -4.0], jnp.bfloat16)}
    expected = np.sqrt(np.sum(np.arange(6.0) ** 2) + 9 + 16)
    np.testing.assert_allclose(float(faults.global_norm(tree)), expected, rtol=1e-6)
    assert bool(faults.is_finite_step(jnp.float32(1.0), tree))


def test_skip_counter():
    counter = faults.SkipCounter(max_consecutive=3)
    assert counter.update(False, 10) == 1
    assert counter.update(False, 11) == 2
    assert counter.update(True, 12) == 0  # An applied update resets the streak.
    assert counter.update(False, 13) == 1
    assert counter.update(False, 14) == 2
    with pytest.raises(RuntimeError) as e:
        counter.update(False, 15, last_checkpoint=12)
    assert "3 consecutive non-finite updates (last at step 15)" in str(e.value)
    assert "the last good checkpoint is step 12" in str(e.value)
    assert counter.total == 5
    with pytest.raises(RuntimeError, match="1 consecutive .* no checkpoint has been saved yet"):
        faults.SkipCounter(1).update(False, 0)
    with pytest.raises(ValueError, match="max_consecutive"):
        faults.SkipCounter(0)
