"""Off-policy corrections (docs/objectives.md, "Off-policy corrections"): GRPO-style group
advantages and a token PPO clip, with one correction of the trainer-vs-generator mismatch
rho = pi_old / pi_sampler chosen by `:correction=NAME`.

    python -m rlscale.main --config configs/off_policy.py --workdir /tmp/rlscale_off_policy

Variants: `:correction=icepop` (default) | `masked_is` | `geometric_rejection` | `k3_rejection`
| `m2po` | `rollout_kl` | `all` (every one at once: the masks before the ratio, the loss-stage
ones after the clip; what the tests' smoke run trains), `:smoke` (3 steps, used by the
tests), `:generator=bfloat16` (default) | `float16` | `float32` | `` (the learner's numerics).
The corrections matter when the generator's logprobs differ from the trainer's: a pipeline run
(`--config.pipeline.mode=pipeline --config.pipeline.max_staleness=4`) or a generator with
other numerics, which this config's is: it samples in bfloat16 beside the float32 learner
(`sampling.generator_dtype`); with the learner's numerics rho is 1 up to float32 rounding in a
synchronous run and nothing is masked. `:smoke,correction=all` (2-core CPU, about a minute
from the tests' warm start): `train/logp_gap_abs` 4.6e-3 to 5.0e-3, Pearson r 0.99998;
geometric_rejection(1 +- 1e-3) masked 54-73% of the tokens, the wider bands nothing.
`:smoke,correction=all,generator=` in pipeline mode with `--config.pipeline.max_staleness=4
--config.steps=20` (2-core CPU, 125 s): staleness 4 from step 5, mean |log rho| 0.01-0.10;
geometric_rejection rejected 87-100% of the sequences per step from step 3, icepop and
masked_is nothing (docs/objectives.md). Pass rates of each correction, with either gap: not
measured yet.
"""

from rlscale import config_lib

# Each correction's parts: batch-stage masks (after the advantages), the ratio, and
# loss-stage transforms after the clip.
CORRECTIONS = {
    "icepop": (["icepop(low=0.5, high=5.0)"], "token_ratio", []),
    "masked_is": ([], "token_ratio(behaviour=trainer)", ["masked_is(low=0.5, high=2.0)"]),
    "geometric_rejection": (["geometric_rejection(low=0.999, high=1.001)"], "token_ratio", []),
    "k3_rejection": (["k3_rejection(max_kl=0.001)"], "token_ratio", []),
    "m2po": (["m2po(tau=0.04)"], "token_ratio", []),
    "rollout_kl": ([], "token_ratio", ["rollout_kl(coef=0.001)"]),
}
CORRECTIONS["all"] = (
    [
        p
        for name in ("icepop", "geometric_rejection", "k3_rejection", "m2po")
        for p in CORRECTIONS[name][0]
    ],
    "token_ratio(behaviour=trainer)",
    CORRECTIONS["masked_is"][2] + CORRECTIONS["rollout_kl"][2],
)


def chain(correction: str) -> str:
    """The objective chain with `correction`'s parts."""
    if correction not in CORRECTIONS:
        raise ValueError(
            f"config variant correction={correction!r} is not one of {', '.join(CORRECTIONS)}"
        )
    masks, ratio, after = CORRECTIONS[correction]
    return " | ".join(
        ["group_advantages", *masks, ratio, "ppo_clip(eps_low=0.2, eps_high=0.28)", *after]
        + ["aggregate(mode=token_mean)"]
    )


def get_config(arg=None):
    arg = config_lib.parse_arg(arg, smoke=False, correction="icepop", generator="bfloat16")
    c = config_lib.rl_config()
    c.recipe = f"off_policy_{arg.correction}"
    c.objective.chain = chain(arg.correction)
    # The generator samples in bfloat16 beside the learner's float32: the gap the corrections
    # are for, in a synchronous run too (`:generator=` "" for the learner's own numerics).
    c.sampling.generator_dtype = arg.generator
    if arg.smoke:
        config_lib.smoke(c)
    return c
