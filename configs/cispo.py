"""CISPO (MiniMax-M1: Chen et al. 2025): a REINFORCE step reweighted by a clipped, detached
importance weight; token-mean loss.

    python -m rlscale.main --config configs/cispo.py --workdir /tmp/rlscale_cispo

Laptop CPU (2 cores), quickstart task (arithmetic, difficulty 2): about 4.5 minutes, of which
the SFT warm start is 2.5 (reuse one with `--config.sft.reuse_from=WORKDIR`; the 40 RL steps
alone took 1m49). Measured result (seed 0): held-out pass@1 0.18 (warm start) -> 0.648 after 40
steps. Any task by override: `--config.task.name=countdown --config.task.difficulty=3`.
Variant `:smoke` runs 3 steps (used by the tests).
"""

from rlscale import config_lib


def get_config(arg=None):
    arg = config_lib.parse_arg(arg, smoke=False)
    c = config_lib.rl_config()
    c.recipe = "cispo"
    c.objective.chain = (
        "group_advantages | token_ratio | cispo(eps_max=None, eps_low=1.0, eps_high=3.0)"
        " | aggregate(mode=token_mean)"
    )
    if arg.smoke:
        config_lib.smoke(c)
    return c
