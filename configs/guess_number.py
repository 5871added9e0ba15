"""Multi-turn RL with feedback between turns: the quickstart's recipe on `guess_number`
(guess a secret in 1..16 in 5 tries at difficulty 2; the environment answers "higher",
"lower" or "correct", docs/environments.md). The reward comes only at the episode's end (1
for a correct guess within the tries, from the environment), so the learner has to credit the
guesses that led to it. The warm start imitates games won mostly by bisection, with a
`jitter` of guesses anywhere in the range left.

    python -m rlscale.main --config configs/guess_number.py --workdir /tmp/rlscale_guess

Variants: `:difficulty=N` (1..2^(N+2) in N+3 tries), `:smoke` (3 steps of everything).
"""

from rlscale import config_lib


def get_config(arg=None):
    arg = config_lib.parse_arg(arg, smoke=False, difficulty=2)
    c = config_lib.rl_config()
    c.recipe = "guess_number"
    c.task.name, c.task.difficulty = "guess_number", arg.difficulty
    c.steps = 80
    c.eval.every = 5
    c.optim.lr = 1.5e-4
    c.objective.chain = config_lib.QUICKSTART_CHAIN
    c.filters.zero_variance = True
    c.sft.answer_line_fraction = 1.0  # A game has no answer line to strip.
    c.env.name = "guess_number"
    c.env.max_turns = arg.difficulty + 4  # The game ends itself after its tries.
    c.env.reply_tokens = 8
    c.env.call_seconds = 5.0
    c.sampling.max_new_tokens = 12 * (arg.difficulty + 3)  # A guess and a reply a try.
    if arg.smoke:
        config_lib.smoke(c)
    return c
