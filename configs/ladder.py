"""A model-size ladder on multi-step arithmetic, for scaling studies with headroom.

    python -m rlscale.main --config configs/ladder.py:size=l --workdir /tmp/ladder_l

The quickstart's warm start rarely states its answer, so its RL curve measures format
learning and saturates at the warm start's own arithmetic accuracy. Here every demonstration
ends with the graded answer line, every size trains the same number of SFT steps (no early
stop) on 40,000 problems (4,000 let the warm start memorize them, and RL on memorized
problems taught nothing), and the problems take `difficulty` operators: what RL can raise is
the accuracy of the working itself. Sizes (`size=`): xs, s, m (the quickstart's policy), l,
xl; `difficulty=` sets the operators (3). Measured (2-core CPU; experiments/ladder), held-out
pass@1 from the warm start to step 200: xs 0.049 -> 0.062, s 0.101 -> 0.116, m 0.207 ->
0.254, l 0.443 -> 0.510 (0.545 at best), xl 0.400 -> 0.474 (undertrained by 600 SFT steps);
1 to 8.5 minutes per run.
Variants: `:smoke` (a few steps of everything).
"""

from rlscale import config_lib

# (num_layers, d_model, num_heads, num_kv_heads): head_dim = d_model / num_heads, the MLP
# three times d_model.
SIZES = {
    "xs": (2, 64, 4, 2),
    "s": (3, 96, 4, 2),
    "m": (4, 128, 4, 2),
    "l": (4, 192, 6, 2),
    "xl": (6, 256, 8, 4),
}


def get_config(arg=None):
    arg = config_lib.parse_arg(arg, size="m", difficulty=3, smoke=False)
    if arg.size not in SIZES:
        raise ValueError(f"config variant size={arg.size!r} is not one of {tuple(SIZES)}")
    c = config_lib.rl_config()
    c.recipe = f"ladder_{arg.size}"
    layers, width, heads, kv_heads = SIZES[arg.size]
    c.model = config_lib.model_config(
        "tiny",
        num_layers=layers,
        d_model=width,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=width // heads,
        mlp_dim=3 * width,
        max_seq_len=128,
    )
    c.task.difficulty = arg.difficulty
    c.sampling.max_new_tokens = 16 * arg.difficulty  # The working of one step per operator.
    c.sft.answer_line_fraction = 1.0
    c.sft.target_pass = 1.1  # Never reached: every size trains the same number of steps.
    c.sft.max_steps = 600
    c.task.n_train = 40_000
    c.steps = 200
    c.eval.every = 20
    c.optim.lr = 7.5e-5
    c.objective.chain = config_lib.QUICKSTART_CHAIN
    c.filters.zero_variance = True
    c.learner.pack_length, c.learner.length_buckets = 128, 1
    if arg.smoke:
        config_lib.smoke(c)
    return c
