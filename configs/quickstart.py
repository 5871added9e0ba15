"""Quickstart: ScaleRL-style RL on multi-step arithmetic with a tiny policy, from scratch.

    python -m rlscale.main --config configs/quickstart.py --workdir /tmp/rlscale_quickstart

Laptop CPU (2 cores): 2 min 13 s measured, SFT warm start (about 1.5 minutes) and
compilation included (2 min 1 s when a previous run filled the compilation cache); 0.29 s
per RL step. Measured result: held-out pass@1 0.15 (the warm start, which works problems out
but rarely states the graded answer) -> 0.806 after 80 RL steps (seed 1: 0.795); the run's
own fit gives A = 0.85. See docs/configs.md, "The
quickstart". In pipeline mode (`--config.pipeline.mode=pipeline
--config.pipeline.max_staleness=4`, measured with lr 1e-4): 0.79.
`:lora` (rank-8 LoRA adapters on every projection, alpha 32, lr 1e-3; docs/learner.md, "LoRA"):

    python -m rlscale.main --config configs/quickstart.py:lora --workdir /tmp/rlscale_lora

measured on 2 CPU cores shared with other sessions' runs (load average about 8): 19 min 20 s,
SFT warm start (900 steps) included, 4 min 28 s from the step-0 evaluation to the end; held-out
pass@1 0.16 -> 0.835 after 80 RL steps (the run's fit: A = 0.843), training 77,953 params
(the adapters and the value head) with 0.62 MB of optimizer state.
`:moe` (the policy a mixture of experts shaped as tiny_moe: 8 experts of width 96, top-2, in
every layer; `moe_aux(lb=0.001)`; the generator's routing replayed in the learner, with the
gap without replay measured too; docs/model_and_sampling.md, "Router replay"):

    python -m rlscale.main --config configs/quickstart.py:moe --workdir /tmp/rlscale_quickstart_moe

measured on 2 CPU cores shared with other sessions' runs (load average 7 to 11): 49 min 19 s,
of which the SFT warm start (900 steps of the MoE, which JAX runs on the CPU as every expert
over every token) about 43 min and 5 min 52 s from the step-0 evaluation to the end;
held-out pass@1 0.164 -> 0.831 after 80 RL steps (the run's fit: A = 0.853); every step's
`train/routing_mismatch` 0, `train/logp_gap_abs` 1.7e-8 to 1.4e-7 and without replay the same
to rounding (mean 6.8e-8 both), `train/moe_lb` 2.23 to 2.51 (2 is uniform over the top-2).
Variants: `:smoke` (3 steps of everything, under a minute: used by the tests), `:demo` (the
sampling demo on a random model), `:entropy_rho=0.2` (train only on each micro-batch's top 20%
of tokens by policy entropy: Wang et al. 2025, "Beyond the 80/20 Rule").
"""

from rlscale import config_lib


def get_config(arg=None):
    arg = config_lib.parse_arg(
        arg, smoke=False, demo=False, model="tiny", entropy_rho=0.0, lora=False, moe=False
    )
    if arg.demo:
        return _demo_config(arg)
    c = config_lib.rl_config()
    c.recipe = "quickstart"
    c.steps = 80
    c.eval.every = 5
    # Measured at step 80 (2 seeds): lr 1e-4 0.789 / 0.79, 1.5e-4 0.8125 / 0.794, 2e-4 0.80.
    c.optim.lr = 1.5e-4
    c.objective.chain = config_lib.QUICKSTART_CHAIN
    if arg.entropy_rho:
        c.objective.chain = c.objective.chain.replace(
            "cispo", f"high_entropy_tokens(rho={arg.entropy_rho}) | cispo"
        )
    c.filters.zero_variance = True
    # Pack the trained sequences into 96-token rows, one completion length: about 40% of a
    # row of one sequence is padding here, and a zero-variance group is not run at all; the run
    # compiles one update program (docs/learner.md).
    c.learner.pack_length, c.learner.length_buckets = 96, 1
    if arg.lora:  # Rank-8 adapters on every projection; the base stays the warm start.
        c.recipe = "quickstart_lora"
        c.lora.rank, c.lora.alpha = 8, 32.0
        c.optim.lr = 1e-3
    if arg.moe:
        _moe(c)
    if arg.smoke:
        config_lib.smoke(c)
        c.learner.pack_length = 0  # The golden runs (tests/golden): one sequence per row.
    return c


def _moe(c):
    """The quickstart's policy as a mixture of experts shaped as `tiny_moe` (8 experts of a
    quarter of the dense MLP's width, top-2, every layer sparse, qk-norm), its load balanced
    by the auxiliary loss Qwen3-MoE trains with, and the generator's routing replayed in the
    learner (both logprob gaps measured)."""
    c.model.update(num_experts=8, experts_per_token=2, moe_intermediate_size=96, qk_norm=True)
    c.objective.chain += " | moe_aux(lb=0.001)"
    c.learner.router_replay, c.learner.replay_probe = "generator", True


def _demo_config(arg):
    import ml_collections

    c = ml_collections.ConfigDict()
    c.recipe = "demo"
    c.seed = 0
    c.model = config_lib.model_config(arg.model)
    c.mesh = dict(shape=(-1, 1, 1))
    c.num_prompts = 4 if arg.smoke else 16
    c.min_prompt_len = 3
    c.max_prompt_len = 24
    c.sampling = config_lib.sampling_config(
        max_new_tokens=8 if arg.smoke else 64,
        temperature=1.0,
        top_k=50,
        top_p=0.95,
        num_samples=2 if arg.smoke else 4,
        stop_tokens=(3,),
        buckets=(16, 32, 64),
    )
    return c
