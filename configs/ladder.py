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
Measured (2-core CPU, 3 RL seeds per size; experiments/ladder), held-out pass@1 of the warm
start -> the final policy (mean over seeds; `rlscale.main.evaluate`, 500 problems x 4 samples):
xs 0.058 -> 0.058, s 0.086 -> 0.111, m 0.224 -> 0.273, l 0.430 -> 0.492, xl 0.683 -> 0.725;
0.5 to 12.5 minutes per run (xl's 1200 SFT steps are most of its first run).
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
