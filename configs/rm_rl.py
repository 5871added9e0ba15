"""Reward-model RL (RLMT-style) on the quickstart's task: the quickstart's recipe with a
Bradley-Terry reward model's score as the reward in place of the verifier's
(docs/preference_and_reward_models.md, "Reward models"). The verifier still measures
correctness, so the run shows both the reward it optimizes and the pass rate it was meant to
buy.

    python -m rlscale.main --config configs/rm_rl.py --workdir /tmp/rlscale_rm_rl \\
        [--config.sft.reuse_from=/tmp/rlscale_quickstart]

The reward model (`reward.model="train_at_setup"`) is trained at set-up from the warm start's
weights on the pairs formed from the warm start's own samples (`batch.group_size` = 8 per training
prompt, the verifier's best against worst; 1 in 10 held out), cached in WORKDIR/reward_model; its
sampling and training count in the run's compute. `--config.reward.model=DIR` uses one
written by `python -m rlscale.main.train_reward_model` instead.

Measured (2-core CPU shared with other runs, the quickstart's warm start reused, 3 seeds;
experiments/paradigms): 69-174 s each, the reward model's making (2,909-2,979 pairs, 200
steps) included; held-out pair accuracy 0.997-1.0. Held-out pass@1 0.149 -> a peak of
0.61-0.66 around step 40, then down to 0.51-0.60 at step 80 while the reward model's mean
reward keeps rising (-2.5 -> 4.0-4.5): reward over-optimization, where the verifier-rewarded
quickstart ends at 0.79. The making costs 1.92e12 FLOPs before the first step.

Variants: `:smoke` (3 steps of everything, used by the tests: a reward model of 20 steps),
`:prm=DIR` (the outcome reward plus a process reward model's step rewards,
`process_advantages(mix=add)`; docs/preference_and_reward_models.md, "Process rewards").
"""

from rlscale import config_lib


def get_config(arg=None):
    arg = config_lib.parse_arg(arg, smoke=False, prm="")
    c = config_lib.rl_config()
    c.recipe = "rm_rl"
    # The quickstart's schedule and policy, so its warm start serves (`sft.reuse_from`) and
    # the curves compare on the same compute axis.
    c.steps = 80
    c.eval.every = 5
    c.optim.lr = 1.5e-4
    c.objective.chain = config_lib.QUICKSTART_CHAIN
    c.reward.model = "train_at_setup"
    c.filters.zero_variance = True  # Judged on the reward model's scores.
    c.learner.pack_length, c.learner.length_buckets = 96, 1
    if arg.prm:
        c.reward.prm = arg.prm
        c.objective.chain = c.objective.chain.replace(
            "token_ratio", "process_advantages(mix=add, coef=0.5) | token_ratio", 1
        )
    if arg.smoke:
        config_lib.smoke(c)
        c.learner.pack_length = 0  # As the quickstart's smoke: the tests' shared warm start.
        c.reward.model_steps = 20
    return c
