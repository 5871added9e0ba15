"""The off-policy study's arms (experiments/off_policy/protocol.md): the chains of
configs/off_policy.py on the ladder's size-l testbed (`config_lib.ladder_testbed`), pipeline
mode with k = 8 (`pipeline.max_staleness`) and a bfloat16 generator beside the float32 learner.

    python -m rlscale.main --config experiments/off_policy/config.py:arm=tis \\
        --workdir /tmp/off_policy/tis_s0 --config.seed=0

Arms (`:arm=`): `none` (PPO's ratio against the trainer's recomputation, the mismatch
ignored), `tis` (the same with truncated importance sampling, cap 2), `generator_ratio`
(PPO's ratio against the generator, configs/off_policy.py's chain with no correction), and
each correction of configs/off_policy.py (`icepop`, `masked_is`, `geometric_rejection`,
`k3_rejection`, `m2po`, `rollout_kl`) with its bands. 200 RL steps of 32 prompts x 8 samples
at lr 7.5e-5 (the testbed's), held-out pass@1 on 500 problems x 4 samples every 20 steps.
`:smoke` shrinks everything (`config_lib.smoke`) and keeps the testbed's model.
"""

import importlib.util
import os

from rlscale import config_lib

_CONFIGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "configs")
CLIP = "ppo_clip(eps_low=0.2, eps_high=0.28)"
AGGREGATE = "aggregate(mode=token_mean)"


def _off_policy():
    """configs/off_policy.py as a module (configs/ is not a package)."""
    path = os.path.join(_CONFIGS, "off_policy.py")
    spec = importlib.util.spec_from_file_location("_configs_off_policy", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def arms() -> dict[str, str]:
    """{arm: objective chain}: the two controls, TIS and configs/off_policy.py's corrections."""
    off_policy = _off_policy()
    out = {
        "none": " | ".join(["group_advantages", "token_ratio(behaviour=trainer)", CLIP, AGGREGATE]),
        "tis": " | ".join(
            ["group_advantages", "token_ratio(behaviour=trainer)", CLIP, "truncated_is(cap=2.0)"]
            + [AGGREGATE]
        ),
        "generator_ratio": " | ".join(["group_advantages", "token_ratio", CLIP, AGGREGATE]),
    }
    for name in off_policy.CORRECTIONS:
        if name != "all":
            out[name] = off_policy.chain(name)
    return out


def get_config(arg=None):
    arg = config_lib.parse_arg(arg, arm="none", smoke=False, size="l")
    chains = arms()
    if arg.arm not in chains:
        raise ValueError(f"config variant arm={arg.arm!r} is not one of {', '.join(chains)}")
    c = _off_policy().get_config("generator=bfloat16")
    config_lib.ladder_testbed(c, arg.size)
    c.recipe = f"off_policy_study_{arg.arm}"
    c.objective.chain = chains[arg.arm]
    c.steps, c.eval.every, c.optim.lr = 200, 20, 7.5e-5
    c.pipeline.mode, c.pipeline.max_staleness = "pipeline", 8
    if arg.smoke:
        config_lib.smoke(c)
    return c
