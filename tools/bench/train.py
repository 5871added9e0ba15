"""The train section: forward + backward of the next-token loss + AdamW
(`supervised.train_step`), against this machine's peak matmul FLOP/s (`common`)."""

import jax
import jax.numpy as jnp

from bench import common
from rlscale import next_token, optim, supervised
from rlscale.scaling.compute import matmul_params


def bench_train(cfg, params, graphdef, batch, seq_len, peak, repeats):
    """One `supervised.train_step` on `batch` x `seq_len` random tokens, the best of
    `repeats`; FLOPs = 6 x (matmul params) x tokens + 12 x layers x heads x head_dim x T per
    token (attention), as a fraction of `peak`. `params` keep their values (the step donates
    a copy)."""
    fit = supervised.Fit(
        next_token.batch_loss, graphdef, optim.OptimConfig(lr=1e-4, weight_decay=1e-4)
    )
    # The step donates its state, as training does; a copy keeps the caller's `params` alive
    # for the sections that run after this one.
    state = supervised.init_state(fit, jax.tree.map(jnp.copy, params))
    tokens = jax.random.randint(jax.random.key(3), (batch, seq_len), 4, cfg.vocab_size)
    data = next_token.Batch(tokens, jnp.ones((batch, seq_len), bool))
    holder = [state]

    def run():
        holder[0], metrics = supervised.train_step(fit, holder[0], data)
        jax.block_until_ready(metrics)

    dt = common.best_time(run, repeats)
    n_tok = batch * seq_len
    flops = 6 * matmul_params(cfg) * n_tok + (
        12 * cfg.num_layers * cfg.num_heads * cfg.head_dim * seq_len * n_tok
    )
    return {
        "batch": batch,
        "seq_len": seq_len,
        "step_s": dt,
        "tokens_per_s": n_tok / dt,
        "flops_per_s": flops / dt,
        "peak_fraction": flops / dt / peak,
    }


def print_train(t):
    """One row of the roofline table (`tools/bench.py` prints its header)."""
    shape = f"B={t['batch']} T={t['seq_len']}"
    print(
        f"{'train':<8}{shape:<22}{t['tokens_per_s']:>12.0f}"
        f"{t['flops_per_s'] / 1e9:>10.1f}{t['peak_fraction']:>10.1%}"
    )
