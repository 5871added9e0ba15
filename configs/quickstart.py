"""Quickstart: today, the sampling demo on a tiny random model.

    python -m rlscale.main --config configs/quickstart.py --workdir /tmp/rlscale_quickstart

Laptop CPU: about 10 s (mostly compilation). Expected output: a summary with tokens/s and
`max_logprob_error_vs_forward` below 1e-4 (the sampler's logprobs equal a full forward pass).
Variants: `:smoke` (fewer prompts and tokens, used by the tests), `:model=small`.
"""

import ml_collections

from rlscale import config_lib


def get_config(arg=None):
    arg = config_lib.parse_arg(arg, smoke=False, model="tiny")
    c = ml_collections.ConfigDict()
    c.seed = 0
    c.model = config_lib.model_config(arg.model)
    c.mesh = dict(shape=(-1, 1, 1))  # (data, fsdp, tensor); -1 takes the remaining devices.
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
