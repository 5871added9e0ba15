"""ScaleRL (Khatri et al. 2025): CISPO (eps_max 4), prompt-mean loss, batch-std advantages, FP32 LM
head, zero-variance filtering, no-positive-resampling, forced length interruption.

    python -m rlscale.main --config configs/scalerl.py --workdir /tmp/rlscale_scalerl

System half: PipelineRL (`pipeline.mode="pipeline"`), no token trained more than
`pipeline.max_staleness=8` updates after the policy that sampled it, one optimizer step per
batch; the CISPO weight divides by the generator's logprobs.

Laptop CPU (2 cores), quickstart task (arithmetic, difficulty 2), the generator and trainer
time-slicing the one device: 80 RL steps in 80 s from the quickstart's warm start (about 1.5
minutes more to build one). Measured result (seed 0): held-out pass@1 0.15 -> 0.78, mean
staleness 6.8 updates (max 8); the run's own fit gives A = 0.89 [0.83, 1.00] (the interval
reaches A's bound: A is not determined by this run), B = 1.9, C_mid = 9.5e11 FLOPs. Any task
by override: `--config.task.name=countdown --config.task.difficulty=3`. Variant `:smoke` runs
3 steps (used by the tests); `:sync` is the synchronous loop with 4 optimizer steps per batch
(the off-policy stand-in the ablations below were measured with: 0.18 -> 0.84 then, on an
older warm start).
Objective: `group_advantages(scale=batch_std) | token_ratio | cispo(eps_max=4.0) |
aggregate(mode=prompt_mean)`.

Ablation variants (experiments/scalerl_ablations):
  :loss=ppo_clip|gspo|cispo   swap the loss, keep the rest of the recipe (the paper's Fig. 5a):
                              ppo_clip is DAPO's clip-higher (0.2/0.28), gspo clips the
                              sequence geometric-mean ratio (3e-4/4e-4).
  :gspo_eps=E                 GSPO's sequence clip: eps_low E, eps_high 4E/3 (the paper's
                              ratio), for sweeping it on a testbed (its 3e-4 was tuned for
                              long outputs).
  :drop=COMPONENT             the recipe minus one component (the paper's leave-one-out):
                              cispo (-> DAPO's clipped loss), prompt_mean (-> token mean),
                              batch_std (-> group std), fp32_head (LM head in the compute dtype;
                              run both sides with `:bf16`), zero_variance, no_positive_resampling,
                              interruption.
  :bf16                       bfloat16 compute (the FP32-head ablation is void in fp32).
  :testbed=SIZE               the ladder's task, policy and warm start instead of the
                              quickstart's (`config_lib.ladder_testbed`, sizes xs..xl;
                              experiments/ladder): 200 steps at lr 7.5e-5, evaluated every 20,
                              the thinking budget 8 tokens short of the completion length.
  :testbed=long_SIZE          the long-completion testbed (`config_lib.long_testbed`: the
                              ladder's policy of that size on long_arithmetic, completions of
                              59 to 264 tokens, 16 prompts x 8 samples, evaluated every 25
                              steps), the thinking budget 16 tokens short.
  :budget=N                   with a testbed: the generation budget N tokens (the thinking
                              budget follows it), for ScaleRL's generation-length comparison.
"""

from rlscale import config_lib

# The `:loss=` choices: ratio and policy loss.
LOSSES = {
    "cispo": "token_ratio | cispo(eps_max=4.0)",
    "ppo_clip": "token_ratio | ppo_clip(eps_low=0.2, eps_high=0.28)",  # DAPO's clip-higher.
    "gspo": "sequence_ratio | ppo_clip(eps_low={eps_low}, eps_high={eps_high})",
}
COMPONENTS = (
    "cispo",
    "prompt_mean",
    "batch_std",
    "fp32_head",
    "zero_variance",
    "no_positive_resampling",
    "interruption",
)


def _short(x: float) -> str:
    """3e-4 as "3e-4" (the chain's text, and so the config's hash, as before the sweep)."""
    mantissa, exponent = f"{x:.3e}".split("e")
    return f"{float(mantissa):g}e{int(exponent)}"


def get_config(arg=None):
    arg = config_lib.parse_arg(
        arg,
        smoke=False,
        loss="cispo",
        drop="",
        bf16=False,
        sync=False,
        testbed="",
        gspo_eps=3e-4,
        budget=0,
    )
    c = config_lib.rl_config()
    c.recipe = "scalerl"
    c.steps = 80
    c.eval.every = 5
    # Forced interruption: working still going after 24 tokens gets " Answer:" appended.
    c.sampling.think_budget = 24
    if arg.testbed:
        kind, _, size = arg.testbed.rpartition("_")
        if kind not in ("", "long"):
            raise ValueError(f"config variant testbed={arg.testbed!r} is not SIZE or long_SIZE")
        testbed = config_lib.long_testbed if kind else config_lib.ladder_testbed
        testbed(c, size)
        c.recipe = f"scalerl_{arg.testbed}"
        c.steps, c.optim.lr = 200, 7.5e-5
        c.eval.every = c.eval.every if kind else 20
        c.sampling.max_new_tokens = arg.budget or c.sampling.max_new_tokens
        # Room after the interruption for " Answer:" and the longest answer's digits.
        c.sampling.think_budget = c.sampling.max_new_tokens - (16 if kind else 8)
    elif arg.budget:
        raise ValueError(f"config variant budget={arg.budget} needs a testbed= (its room)")
    # The system half (docs/pipeline.md): a generator that takes new weights between
    # decode steps, no token trained more than 8 updates after the policy that sampled it
    # (the paper's k = 8), one optimizer step per batch. `:sync` runs the synchronous loop.
    if arg.sync:
        c.learner.minibatches = 4  # Off-policy minibatches stand in for the pipeline's lag.
    else:
        c.pipeline.mode, c.pipeline.max_staleness = "pipeline", 8
    c.model.fp32_lm_head = True
    c.filters.zero_variance = True
    c.filters.retire = True
    c.filters.retire_threshold = 0.9
    if not arg.gspo_eps > 0 or (arg.gspo_eps != 3e-4 and arg.loss != "gspo"):
        raise ValueError(f"config variant gspo_eps={arg.gspo_eps} needs loss=gspo and > 0")
    if arg.loss not in LOSSES:
        raise ValueError(f"config variant loss={arg.loss!r} is not cispo, ppo_clip or gspo")
    if arg.drop and arg.drop not in COMPONENTS:
        raise ValueError(f"config variant drop={arg.drop!r} is not one of {COMPONENTS}")
    # The objective, one part per component the ablations swap or drop.
    objective = dict(
        advantages="group_advantages(scale=batch_std)",
        loss=LOSSES["ppo_clip" if arg.drop == "cispo" else arg.loss].format(
            eps_low=_short(arg.gspo_eps), eps_high=_short(arg.gspo_eps * 4 / 3)
        ),
        aggregate="aggregate(mode=prompt_mean)",
    )
    if arg.drop == "prompt_mean":
        objective["aggregate"] = "aggregate(mode=token_mean)"
    elif arg.drop == "batch_std":
        objective["advantages"] = "group_advantages"  # Group-std scaling.
    elif arg.drop == "fp32_head":
        c.model.fp32_lm_head = False
    elif arg.drop == "zero_variance":
        c.filters.zero_variance = False
    elif arg.drop == "no_positive_resampling":
        c.filters.retire = False
    elif arg.drop == "interruption":
        c.sampling.think_budget = 0
    c.objective.chain = " | ".join(objective.values())
    if arg.bf16:
        c.model.dtype = "bfloat16"
    if arg.smoke:
        config_lib.smoke(c)
    return c
