"""A model-size ladder on multi-step arithmetic, for scaling studies with headroom.

    python -m rlscale.main --config configs/ladder.py:size=l --workdir /tmp/ladder_l

The quickstart's warm start rarely states its answer, so its RL curve measures format
learning and saturates at the warm start's own arithmetic accuracy. Here every demonstration
ends with the graded answer line, each size trains a fixed number of SFT steps (no early
stop) on 40,000 problems (4,000 let the warm start memorize them, and RL on memorized
problems taught nothing), and the problems take `difficulty` operators: what RL can raise is
the accuracy of the working itself (`config_lib.ladder_testbed`). Sizes (`size=`): xs, s, m
(the quickstart's policy), l, xl; `difficulty=` sets the operators (3). RL: the quickstart's
recipe (CISPO, prompt-mean aggregation, zero-variance filter), 200 steps at lr 7.5e-5.
Measured (2-core CPU; experiments/ladder), held-out pass@1 from the warm start to step 200:
xs 0.049 -> 0.062, s 0.101 -> 0.116, m 0.207 -> 0.254, l 0.443 -> 0.510 (0.545 at best),
xl 0.400 -> 0.474 (undertrained by 600 SFT steps); 1 to 8.5 minutes per run.
Variants: `:smoke` (a few steps of everything).
"""

from rlscale import config_lib


def get_config(arg=None):
    arg = config_lib.parse_arg(arg, size="m", difficulty=3, smoke=False)
    c = config_lib.ladder_testbed(config_lib.rl_config(), arg.size, arg.difficulty)
    c.recipe = f"ladder_{arg.size}"
    c.steps = 200
    c.eval.every = 20
    c.optim.lr = 7.5e-5
    c.objective.chain = config_lib.QUICKSTART_CHAIN
    c.filters.zero_variance = True
    if arg.smoke:
        config_lib.smoke(c)
    return c
