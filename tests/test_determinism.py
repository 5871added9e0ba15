"""The determinism contract (docs/reliability.md#determinism): on one machine a run equals
itself bit for bit and equals its kill-and-resume (tests/test_reliability.py,
`test_sigkill_then_resume_is_the_same_run`: the killed run's lines before the kill are a second
run of the straight run's config, its lines after are the resume's; both equal the straight
run's, line for line); a float32 synchronous run's sampler logprobs
are the trainer's math on logits that differ only by the order the matmuls add in (a decode
step's shapes are not the full forward's), so they agree to float32 rounding, not bit for
bit."""

import numpy as np
from conftest import random_decoder_params, rounding
from test_generator_precision import sample_and_rescore

from rlscale.sampling import SamplingConfig

# The float32 reductions a logprob of the tiny model comes through, per block: the two
# RMSNorms' means, the q/k/v projections, the attention scores, softmax and its values, the
# output projection, the gate and up projections, the down projection; then the final norm,
# the LM head and the log-sum-exp: 2 x 10 + 3. Each has at most 256 terms (d_model 64, MLP
# 128, vocabulary 256).
REDUCTIONS, TERMS = 23, 256


def test_float32_generator_logprobs_equal_the_trainers_to_rounding(tiny_cfg):
    """A float32 generator's logprobs against the trainer's recomputation, token by token.
    Not bit for bit: the generator's matmuls have other shapes than the trainer's (one
    token per row against whole rows), and XLA:CPU sums a row's products in an order that
    depends on the shape (its kernels' blocking); so does cuBLAS. Even the same logprob
    formula, compiled into the sampler's program and the trainer's, may sum the vocabulary in
    another order where XLA fuses it differently. Each of the `REDUCTIONS`
    then moves by at most `rounding(TERMS)` of its terms' magnitudes, the RMSNorms keep the
    activations O(1), and relative differences add along the chain: |dlogp_t| <=
    REDUCTIONS rounding(TERMS) (1 + |logp_t|) (measured: at most 2.4e-6, a hundredth of it).
    A bfloat16 generator is far outside (test_generator_precision)."""
    params = random_decoder_params(tiny_cfg, 0)
    scfg = SamplingConfig(max_new_tokens=16, num_samples=2, buckets=(16,))
    sampler, trainer, mask = sample_and_rescore(tiny_cfg, params, "float32", scfg)
    tol = REDUCTIONS * rounding(TERMS) * (1.0 + np.abs(trainer))
    assert np.all(np.abs(trainer - sampler)[mask] <= tol[mask])
    low, trainer_low, _ = sample_and_rescore(tiny_cfg, params, "bfloat16", scfg)
    assert np.mean(np.abs(trainer_low - low)[mask] > tol[mask]) > 0.5
