"""ScaleRL (Khatri et al. 2025): CISPO (eps_max 4), prompt-mean loss, batch-std advantages, FP32 LM
head, zero-variance filtering, no-positive-resampling, forced length interruption.

    python -m rlscale.main --config configs/scalerl.py --workdir /tmp/rlscale_scalerl

Laptop CPU (2 cores): about 5 minutes on the quickstart task (arithmetic, difficulty 2),
SFT warm start included. Any task by override: `--config.task.name=countdown
--config.task.difficulty=3`. Variant `:smoke` runs 3 steps (used by the tests).
"""

from rlscale import config_lib


def get_config(arg=None):
    arg = config_lib.parse_arg(arg, smoke=False)
    c = config_lib.rl_config()
    c.recipe = "scalerl"
    c.objective.advantages.scale = "batch_std"
    c.objective.policy.name = "cispo"
    c.objective.policy.eps_max = 4.0
    c.objective.aggregate = "prompt_mean"
    c.model.fp32_lm_head = True
    c.filters.zero_variance = True
    c.filters.retire = True
    c.filters.retire_threshold = 0.9
    # Forced interruption: working still going after 24 tokens gets " Answer:" appended.
    c.sampling.think_budget = 24
    if arg.smoke:
        config_lib.smoke(c)
    return c
