"""GSPO (Zheng et al. 2025): sequence-level geometric-mean ratio with a tight clip, one value per
sequence.

    python -m rlscale.main --config configs/gspo.py --workdir /tmp/rlscale_gspo

Laptop CPU (2 cores), quickstart task (arithmetic, difficulty 2): about 4.5 minutes, of which
the SFT warm start is 2.5 (reuse one with `--config.sft.reuse_from=WORKDIR`; the 40 RL steps
alone took 2m00). Measured result (seed 0): held-out pass@1 0.18 (warm start) -> 0.664 after 40
steps. Any task by override: `--config.task.name=countdown --config.task.difficulty=3`.
Variant `:smoke` runs 3 steps (used by the tests).
"""

from rlscale import config_lib


def get_config(arg=None):
    arg = config_lib.parse_arg(arg, smoke=False)
    c = config_lib.rl_config()
    c.recipe = "gspo"
    c.objective.chain = (
        "group_advantages | sequence_ratio | ppo_clip(eps_low=3e-4, eps_high=4e-4)"
        " | aggregate(mode=seq_mean_token_mean)"
    )
    if arg.smoke:
        config_lib.smoke(c)
    return c
