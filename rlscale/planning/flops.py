"""FLOPs per RL step: the compiled programs' count with their loops at their trip counts
(`loop_factor`), and the model's own count of a step's useful work (`model_flops`,
`scaling.compute`: a mixture of experts' active parameters only).
"""

import math

import jax.extend as jex

from rlscale.scaling import compute


def _dot_flops(eqn) -> float:
    lhs, rhs = (v.aval.shape for v in eqn.invars[:2])
    (_, rhs_contract), (_, rhs_batch) = eqn.params["dimension_numbers"]
    free = [d for i, d in enumerate(rhs) if i not in (*rhs_contract, *rhs_batch)]
    return 2.0 * math.prod(lhs) * math.prod(free)


def matmul_flops(jaxpr, loops: bool = True, while_trips: float = 1.0) -> float:
    """The matmul FLOPs (dot_general, 2 per multiply-add) of a jaxpr and its sub-jaxprs.

    With `loops`, a `scan` body counts `length` times and a `while_loop` body (whose trip
    count is data-dependent) `while_trips` times; without, every loop body counts once
    (XLA's cost-analysis convention). A `cond` counts its most expensive branch.
    """
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    total = 0.0
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "dot_general":
            total += _dot_flops(eqn)
            continue
        subs = list(jex.core.jaxprs_in_params(eqn.params))
        if not subs:
            continue
        inner = [matmul_flops(s, loops, while_trips) for s in subs]
        if name == "cond":
            total += max(inner)
        elif name == "scan" and loops:
            total += eqn.params["length"] * sum(inner)
        elif name == "while" and loops:
            total += while_trips * sum(inner)
        else:
            total += sum(inner)
    return total


def loop_factor(jaxpr, while_trips: float = 1.0) -> float:
    """How many times more matmul FLOPs a program runs than its loop bodies counted once."""
    once = matmul_flops(jaxpr, loops=False)
    return matmul_flops(jaxpr, loops=True, while_trips=while_trips) / once if once else 1.0


def model_flops(config, model_cfg, prompt_bucket: int) -> dict:
    """`scaling.compute`'s FLOPs of one RL step's worst-case batch (every completion
    `max_new_tokens` long), as the run's own `compute/*` counters count them (`rl.report`):
    "update", a training pass (forward and backward) over the batch's rows x (prompt bucket
    + completion) tokens, and "generate", a forward pass over the prompts (once each) and
    the completions, at the mean context of prompt bucket + half the completion. With
    `learner.shared_prefix` the update runs a group's prompt once, but its last token, which
    each sample keeps (`batch_layout.forward_tokens`)."""
    B, G = config.batch.prompts, config.batch.group_size
    M, P = config.sampling.max_new_tokens, prompt_bucket
    ctx = P + M / 2
    trained = B * G * (P + M)
    if config.learner.shared_prefix:
        trained -= B * (G - 1) * (P - 1)
    return {
        "update": compute.train_flops(model_cfg, trained, ctx),
        "generate": compute.forward_flops(model_cfg, B * prompt_bucket + B * G * M, ctx),
    }
