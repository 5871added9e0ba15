"""Attention implementations (`rlscale.model.attention`) side by side on this machine.

    python tools/bench_attention.py [--seq_lens 512,2048] [--windows 0,256] \\
        [--implementations xla,dot_product] [--heads 8 --kv_heads 4 --head_dim 64]

For each implementation, row length T and sliding window: the gradient of a loss of one
call's output (forward + backward; one row of four packed sequences), compiled once, and
XLA's cost analysis of the compiled program (FLOPs, temporaries) with the best of
--repeats wall-clock times. FLOPs and temporaries are properties of the program; the times
are this machine's. Results: docs/model_and_sampling.md#attention-implementations.
"""

import time


def define_flags(fv, argv) -> None:
    del argv
    from absl import flags

    flags.DEFINE_list("seq_lens", ["512", "2048"], "Row lengths T.", flag_values=fv)
    flags.DEFINE_list("windows", ["0", "256"], "Sliding windows (0: off).", flag_values=fv)
    flags.DEFINE_list(
        "implementations", ["xla", "dot_product"], "Registered names.", flag_values=fv
    )
    flags.DEFINE_integer("heads", 8, "Query heads H.", flag_values=fv)
    flags.DEFINE_integer("kv_heads", 4, "Key/value heads K.", flag_values=fv)
    flags.DEFINE_integer("head_dim", 64, "Head dim E.", flag_values=fv)
    flags.DEFINE_integer("repeats", 5, "Timed calls (the best is reported).", flag_values=fv)


def measure(name: str, T: int, window: int, H: int, K: int, E: int, repeats: int) -> dict:
    """GFLOP, temporaries (MiB) and the best time (ms) of one forward + backward."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from rlscale.model import attention

    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(1, T, H, E)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(1, K, E, T)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(1, K, T, E)), jnp.float32)
    segments = jnp.asarray(np.repeat(np.arange(1, 5), -(-T // 4))[None, :T], jnp.int32)
    mask = attention.training_mask(None, segments, window)

    def loss(q, k, v):
        o = attention.apply(name, q, k, v, mask, scale=E**-0.5, window=window)
        return jnp.sum(o.astype(jnp.float32) ** 2)

    compiled = jax.jit(jax.grad(loss, (0, 1, 2))).lower(q, k, v).compile()
    jax.block_until_ready(compiled(q, k, v))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(compiled(q, k, v))
        times.append(time.perf_counter() - start)
    cost = compiled.cost_analysis()
    return {
        "gflop": cost["flops"] / 1e9,
        "temp_mib": compiled.memory_analysis().temp_size_in_bytes / 2**20,
        "ms": min(times) * 1e3,
    }


def main(fv) -> None:
    import jax

    from rlscale import cli
    from rlscale.model import attention

    for name in fv.implementations:
        if name not in attention.names():
            cli.fail(f"--implementations: {name!r} is not one of {attention.names()}")
        trouble = attention.platform_problems(name)
        if trouble:
            cli.fail(f"--implementations: {trouble[0]}")
    print(f"{jax.devices()[0].device_kind}, H={fv.heads} K={fv.kv_heads} E={fv.head_dim}")
    print("| attention | T | window | GFLOP | temporaries MiB | ms |")
    print("| --- | --- | --- | --- | --- | --- |")
    for T in map(int, fv.seq_lens):
        for window in map(int, fv.windows):
            for name in fv.implementations:
                r = measure(name, T, window, fv.heads, fv.kv_heads, fv.head_dim, fv.repeats)
                print(
                    f"| `{name}` | {T} | {window} | {r['gflop']:.2f} | "
                    f"{r['temp_mib']:.0f} | {r['ms']:.0f} |",
                    flush=True,
                )


if __name__ == "__main__":
    from rlscale import cli

    cli.run_command(define_flags, main)
