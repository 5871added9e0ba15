"""On-policy distillation on the quickstart's task: the quickstart's warm start (the student)
samples, a stronger policy (the teacher) scores every sampled token, and the per-token reverse
KL is the advantage (`distill_advantage`; docs/objectives.md, "On-policy distillation").

    # The teacher: a quickstart run's final policy.
    python -m rlscale.main --config configs/quickstart.py --workdir /tmp/rlscale_quickstart
    # The student: the same warm start (copied, with the data and the tokenizer the teacher
    # was trained with), distilled from that policy.
    python -m rlscale.main --config configs/distill.py --workdir /tmp/rlscale_distill \\
        --config.teacher.checkpoint=/tmp/rlscale_quickstart/final \\
        --config.sft.reuse_from=/tmp/rlscale_quickstart

Measured (2-core CPU, shared with other runs; teacher: the quickstart run that ends at
held-out pass@1 0.806): 101 s for 80 steps from the copied warm start; held-out pass@1 0.149
-> 0.711 at step 40 -> 0.755 at step 80 (seed 0), against the teacher's own RL run 0.719 and
0.806 at the same steps; 3 seeds end at 0.765 [0.755, 0.777]. The teacher's forward passes
count in compute/flops: 0.6 at 1.30e12 FLOPs against online RL's 9.6e11
(experiments/paradigms).
Variants: `:smoke` (3 steps of everything, used by the tests), whose teacher is `self`: the
run's own warm start, so it needs no other run (and its advantage is zero up to the sampler's
numerics at the first step).
"""

from rlscale import config_lib

CHAIN = "distill_advantage | token_ratio | cispo(eps_max=4.0) | aggregate(mode=token_mean)"


def get_config(arg=None):
    arg = config_lib.parse_arg(arg, smoke=False)
    c = config_lib.rl_config()
    c.recipe = "distill"
    # The quickstart's schedule and policy, so its warm start is the student
    # (`sft.reuse_from`) and the two runs' curves compare step for step.
    c.steps = 80
    c.eval.every = 5
    c.optim.lr = 1.5e-4
    c.objective.chain = CHAIN
    # Every sampled token carries the teacher's signal: no group is uninformative, so no
    # zero-variance filter (the verifier's reward is reported, not trained on).
    c.filters.zero_variance = False
    c.learner.pack_length, c.learner.length_buckets = 96, 1
    if arg.smoke:
        config_lib.smoke(c)
        c.learner.pack_length = 0  # As the quickstart's smoke: the tests' shared warm start.
        c.teacher.checkpoint = "self"
    return c
