"""Tool-integrated RL: the quickstart's recipe on `tool_arithmetic` (a*b+c over 5-digit
numbers at difficulty 1), with the sandboxed Python tool (`env.name="python_tool"`,
docs/environments.md). The warm start calls the tool on 30% of its demonstrations and
states the answer directly on the rest, which a tiny policy cannot compute: RL has to find
that the tool pays.

    python -m rlscale.main --config configs/tool_rl.py --workdir /tmp/rlscale_tool_rl

Measured (experiments/tool_rl, 2 seeds, one warm start, on a 2-core CPU shared with other
jobs: about an hour each there, at load 15-24): held-out pass@1 0.24 -> 0.97 and episodes
that run code 0.25-0.27 -> 0.99 in 40 steps; with the tool disabled (`:tool=False`)
0.00 -> 0.00.

Variants: `:tool=False` (the same run with the tool disabled: a single-turn task, so a code
block the policy writes gets no output), `:difficulty=N` (4 + N digits, N in 1..5),
`:smoke` (3 steps of everything: the tests).
"""

from rlscale import config_lib


def get_config(arg=None):
    arg = config_lib.parse_arg(arg, smoke=False, tool=True, difficulty=1)
    c = config_lib.rl_config()
    c.recipe = "tool_rl"
    c.task.name, c.task.difficulty = "tool_arithmetic", arg.difficulty
    c.steps = 40  # Tool use and accuracy rise within the first 10-15 steps.
    c.eval.every = 2  # Six evaluations in the first third: enough for the early fits.
    c.optim.lr = 1.5e-4
    c.objective.chain = config_lib.QUICKSTART_CHAIN
    c.filters.zero_variance = True
    # Every demonstration states its answer: the direct ones are what the tool competes with.
    c.sft.answer_line_fraction = 1.0
    # A tool episode: the code block (about 25 tokens), the reply (about 15) and the answer.
    c.sampling.max_new_tokens = 80
    c.sampling.buckets = (16, 32, 64, 128)
    c.model.max_seq_len = 128
    if arg.tool:
        c.env.name = "python_tool"
        c.env.kwargs = dict(wall_seconds=2.0, cpu_seconds=1)
        c.env.max_turns = 2  # One call and the answer; a second call is allowed.
        c.env.reply_tokens = 24
        c.env.call_seconds = 5.0
        c.env.episode_seconds = 30.0
    if arg.smoke:
        config_lib.smoke(c)
    return c
