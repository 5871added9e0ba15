"""Iterative (semi-online) DPO on the quickstart's task: every 10 steps a round samples 8
completions of each of 320 training prompts with the current policy, the verifier scores
them, each prompt's best and worst form a pair, and the next 10 steps train `dpo(beta=0.1)`
on those pairs against the policy of the round's start (Xiong et al. 2024, arXiv
2312.11456; Pang et al. 2024, arXiv 2404.19733; docs/preference_and_reward_models.md).

    python -m rlscale.main --config configs/iterative_dpo.py --workdir /tmp/rlscale_idpo \\
        [--config.sft.reuse_from=/tmp/rlscale_quickstart]

Runtime and result (one seed, 2-core CPU shared with other runs, the quickstart's warm start
reused): 34 s, a median 0.11 s per training step and 1.1-1.5 s per round of sampling.
Held-out pass@1 0.149 -> 0.761 at step 80 (1.14e12 FLOPs; best 0.773 at step 65); 0.6 / 0.7
at 4.91e11 / 5.36e11 FLOPs where the quickstart needs 1.07e12 / 1.24e12 (its 0.806 at step
80 costs 2.62e12), under this accounting: each update trains 64 sequences (32 pairs) where
the quickstart's trains 256 (experiments/paradigms: 2.1-2.2x over 3 seeds). Rounds form 265
pairs (of 320 prompts) at first, 138 in the last, as the policy passes 19% then 89% of its
samples (docs/preference_and_reward_models.md).
Variants: `:smoke` (3 steps of everything, rounds every 2 steps, used by the tests),
`:every=K` (a round every K steps, of K x batch.prompts prompts), `:pairs=all` (every
correct x incorrect pair of a prompt, not only its best and worst).
"""

from rlscale import config_lib


def get_config(arg=None):
    arg = config_lib.parse_arg(arg, smoke=False, every=10, pairs="best_vs_worst")
    c = config_lib.rl_config()
    c.recipe = "iterative_dpo"
    # The quickstart's schedule and policy, so its warm start serves (`sft.reuse_from`) and
    # the curves compare on the same compute axis.
    c.steps = 80
    c.eval.every = 5
    c.optim.lr = 1.5e-4
    c.objective.chain = "dpo(beta=0.1)"
    c.batch.group_size = 2  # Pairs: batch.prompts = 32 pairs (64 rows) per step.
    c.preference.iterations_every = arg.every
    c.preference.samples = 8
    c.preference.pairs = arg.pairs
    c.learner.pack_length, c.learner.length_buckets = 96, 1
    if arg.smoke:
        config_lib.smoke(c)
        c.batch.group_size = 2
        c.preference.iterations_every = 2  # Rounds before steps 1 and 3.
        c.preference.samples = 4
        c.learner.pack_length = 0  # As the quickstart's smoke: the tests' shared warm start.
    return c
