"""XLA:CPU code generation the test oracles depend on (`conftest.jit_without_ynn`)."""

import jax.numpy as jnp
import numpy as np
from conftest import U, jit_without_ynn, rounding


def _broadcast_into_a_reduction(a_NBTD, d_BTD, s_BT1):
    """An RMS norm's backward pass as `jax.vmap` batches it over N cotangents: the unbatched
    d and s are broadcast over the new leading axis N."""
    r_NBT1 = jnp.sum(d_BTD[None] * a_NBTD, -1, keepdims=True) * s_BT1[None] / d_BTD.shape[-1]
    return d_BTD[None] * r_NBT1


def test_oracle_programs_compute_a_broadcast_into_a_reduction_exactly():
    """jaxlib 0.10.2 compiles `_broadcast_into_a_reduction` at these shapes into a YNNPACK
    fusion whose result is wrong by the size of the values (5.6 against at most 3.2, where
    N = 8 is right); without YNNPACK fusions it is the float64 NumPy value within float32
    rounding of its 32-term sums. Every Jacobian a test takes with `jax.jacrev` (a vmapped
    backward pass) is such a program: `jit_without_ynn` compiles them."""
    rng = np.random.default_rng(0)
    a = rng.normal(size=(144, 4, 12, 32)).astype(np.float32)
    d = rng.normal(size=(4, 12, 32)).astype(np.float32)
    s = rng.normal(size=(4, 12, 1)).astype(np.float32)
    want = d[None] * (np.sum(d[None] * a.astype(np.float64), -1, keepdims=True) * s[None] / 32)
    got = np.asarray(jit_without_ynn(_broadcast_into_a_reduction)(a, d, s))
    # The sum's rounding, and one rounding each for its three products.
    magnitude = np.abs(d[None] * s[None]) / 32 * np.abs(d[None] * a).sum(-1, keepdims=True)
    assert np.all(np.abs(got - want) <= (rounding(32) + 3 * U) * magnitude)
    # The same function through the same helper with static arguments and a second shape.
    double = jit_without_ynn(lambda k, x: k * jnp.sum(x), static_argnums=0)
    assert float(double(2, np.ones(3, np.float32))) == 6.0
    assert float(double(2, np.ones(4, np.float32))) == 8.0
