"""The auxiliary losses of a mixture-of-experts policy (`rlscale.model.moe`), added to the
objective: the routers' load balance and z-loss, computed by the learner's forward pass over
each micro-batch's real tokens (`rl.forward.token_terms`: `moe_lb`, `moe_z`)."""

from rlscale.objectives.core import Transform, add_metrics, require, stateless
from rlscale.objectives.registry import register


@register(
    "moe_aux",
    stage="loss",
    requires=("loss_sum", "denominator", "moe_lb", "moe_z"),
    provides=("loss_sum", "denominator"),
)
def moe_aux(lb: float = 0.001, z: float = 0.0) -> Transform:
    """Adds lb * L_balance + z * L_z to the aggregated loss of each micro-batch:

    loss_sum += denominator * (lb * moe_lb + z * moe_z)

    so the optimizer step's loss, sum(loss_sum) / sum(denominator), gains the micro-batches'
    auxiliary losses averaged with the aggregation's weights. `moe_lb` is E sum_e f_e P_e
    (Switch Transformer, Fedus et al. 2021; k under uniform routing, as Qwen3-MoE's
    `router_aux_loss_coef`, 0.001, weighs it) and `moe_z` the mean squared router
    log-partition (ST-MoE, Zoph et al. 2022). Place it after the aggregation.
    """
    if lb < 0 or z < 0:
        raise ValueError(f"lb={lb} and z={z} must be >= 0")

    def fn(terms):
        require(terms, "loss_sum", "denominator", "moe_lb", "moe_z", by="moe_aux")
        aux = lb * terms["moe_lb"] + z * terms["moe_z"]
        terms = add_metrics(terms, moe_lb=terms["moe_lb"], moe_z=terms["moe_z"])
        return {**terms, "loss_sum": terms["loss_sum"] + terms["denominator"] * aux}

    return stateless(fn)
