"""The MoE/LoRA study's arms (experiments/moe_lora/protocol.md), on the ladder's size-l
testbed (configs/ladder.py:size=l: the quickstart's recipe, 200 RL steps, lr 7.5e-5, held-out
pass@1 on 500 problems x 4 samples every 20 steps).

    python -m rlscale.main --config experiments/moe_lora/config.py:arm=moe \\
        --workdir /tmp/moe_lora/a_moe_s0 --config.seed=0

Arms (`:arm=`):
  dense          the ladder's l policy (1.84M parameters), synchronous.
  moe            the same width with every MLP a mixture of 8 experts of width 288, top-2
                 (Qwen3-MoE routing, renormalised): 5.83M parameters, 1.85M active (the dense
                 model's 1.84M plus the routers), with `moe_aux(lb=0.001)`; synchronous.
  replay_on      `moe` in pipeline mode with k = 8 and a bfloat16 generator, the learner
                 replaying the generator's routing (`learner.router_replay="generator"`).
  replay_off     the same without replay.
  lora           the dense arm training rank `lora_rank` adapters on every projection
                 (alpha 32, configs/quickstart.py:lora's), or full fine-tuning at rank 0.
`:lr=X` sets the learning rate (0: the arm's default: 7.5e-5; LoRA 7.5e-4, ten times,
after "LoRA Without Regret"). `:smoke` shrinks everything (`config_lib.smoke`).
"""

import importlib.util
import os

from rlscale import config_lib

_CONFIGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "configs")
ARMS = ("dense", "moe", "replay_on", "replay_off", "lora")
MOE = dict(num_experts=8, experts_per_token=2, moe_intermediate_size=288, norm_topk_prob=True)
MOE_AUX = "moe_aux(lb=0.001, z=0.0)"
LR, LORA_LR, LORA_ALPHA = 7.5e-5, 7.5e-4, 32.0


def _ladder():
    """configs/ladder.py as a module (configs/ is not a package)."""
    path = os.path.join(_CONFIGS, "ladder.py")
    spec = importlib.util.spec_from_file_location("_configs_ladder", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def get_config(arg=None):
    arg = config_lib.parse_arg(arg, arm="dense", lora_rank=0, lr=0.0, smoke=False)
    problems = []
    if arg.arm not in ARMS:
        problems.append(f"config variant arm={arg.arm!r} is not one of {', '.join(ARMS)}")
    if arg.lora_rank and arg.arm != "lora":
        problems.append(f"config variant lora_rank={arg.lora_rank} needs arm=lora")
    if arg.lora_rank < 0 or arg.lr < 0:
        problems.append(f"config variants lora_rank={arg.lora_rank}, lr={arg.lr} must be >= 0")
    if problems:
        raise ValueError("; ".join(problems))
    c = _ladder().get_config("size=l")
    c.recipe = f"moe_lora_{arg.arm}"
    if arg.arm in ("moe", "replay_on", "replay_off"):
        for key, value in MOE.items():
            c.model[key] = value
        c.objective.chain = f"{c.objective.chain} | {MOE_AUX}"
    if arg.arm in ("replay_on", "replay_off"):
        c.pipeline.mode, c.pipeline.max_staleness = "pipeline", 8
        c.sampling.generator_dtype = "bfloat16"
        c.learner.router_replay = "generator" if arg.arm == "replay_on" else "off"
    c.optim.lr = arg.lr or LR
    if arg.arm == "lora" and arg.lora_rank:
        c.lora.rank, c.lora.alpha = arg.lora_rank, LORA_ALPHA
        c.optim.lr = arg.lr or LORA_LR
    if arg.smoke:
        config_lib.smoke(c)
    return c
