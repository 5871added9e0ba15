"""What the benchmark sections share: timing (the best of a few runs, after a first run that
compiles) and this machine's measured roofline (peak matmul FLOP/s, memory bandwidth)."""

import time

import jax
import jax.numpy as jnp


def best_time(fn, repeats):
    """The shortest wall time of `repeats` calls of `fn`, after an untimed first call that
    compiles and warms up. `fn` must wait for its results (`block_until_ready`)."""
    fn()  # Compile and warm up.
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def peak_matmul_flops(dtype, sizes=(1024, 2048, 3072), calls=1):
    """The best FLOP/s of square `dtype` matmuls of `sizes`, each timed over `calls`
    back-to-back calls (more hide the dispatch time of a fast accelerator)."""
    best = 0.0
    for n in sizes:
        a = jax.random.normal(jax.random.key(0), (n, n), dtype)
        b = jax.random.normal(jax.random.key(1), (n, n), dtype)
        f = jax.jit(lambda a, b: a @ b)

        def run(f=f, a=a, b=b):
            jax.block_until_ready([f(a, b) for _ in range(calls)])

        best = max(best, 2 * n**3 * calls / best_time(run, 5))
    return best


def memory_bandwidth(nbytes=512 << 20, calls=1):
    """Bytes/s of a large reduction (`nbytes` of float32 read, a scalar written: reads only,
    as decode's weight and cache reads are), timed over `calls` back-to-back calls."""
    x = jnp.ones((nbytes // 4,), jnp.float32)
    f = jax.jit(jnp.sum)
    run = lambda: jax.block_until_ready([f(x) for _ in range(calls)])
    return nbytes * calls / best_time(run, 5)
