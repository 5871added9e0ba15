"""A low-precision generator (`sampling.generator_dtype`, `sampling.precision`): its start-up
checks naming the key, its derived model and cast, its KV cache's dtype and the planner's
bytes for it, the gap its logprobs open to the float32 trainer's (bfloat16 and float16,
against each one's rounding), and the per-token log-ratio histogram (`rl.logp_match`) that
`metrics.MetricWriter` writes to TensorBoard. The bfloat16 generator in a whole run, with the
off-policy corrections: tests/test_corrections.py."""

import glob
import os
import struct

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import load_config, random_decoder_params
from tensorboardX.proto import event_pb2

from rlscale import metrics, model, rl, sharding
from rlscale.model import decoder
from rlscale.planning import planner
from rlscale.rl import forward, logp_match
from rlscale.sampling import Sampler, SamplingConfig, generator, precision
from rlscale.sampling.sampler import _Layout

# ------------------------------------------------------------------------------------------
# Start-up checks and the derived generator.
# ------------------------------------------------------------------------------------------


def test_bad_generator_dtype_fails_at_start_up_naming_the_key():
    config = load_config("quickstart")
    config.sampling.generator_dtype = "fp8"
    with pytest.raises(ValueError) as e:
        rl.resolve(config)
    assert (
        "sampling.generator_dtype='fp8' is not one of '', 'float32', 'bfloat16', 'float16' "
        "('': the learner's)"
    ) in str(e.value)
    assert precision.problems("float16", platform="tpu") == [
        "sampling.generator_dtype='float16': this host's tpu has no float16 arithmetic; use "
        "'bfloat16'"
    ]
    assert precision.problems("float16", platform="gpu") == []
    config.sampling.generator_dtype = "bfloat16"
    assert rl.resolve(config).sampling.generator_dtype == "bfloat16"


def test_generator_model_and_cast(tiny_cfg):
    assert precision.generator_model(tiny_cfg, "") is tiny_cfg
    assert precision.generator_model(tiny_cfg, "float32") is tiny_cfg  # Its own dtypes.
    low = precision.generator_model(tiny_cfg, "bfloat16")
    assert (low.dtype, low.param_dtype, low.fp32_lm_head) == ("bfloat16", "bfloat16", True)
    assert model.as_dict(low) == {
        **model.as_dict(tiny_cfg),
        "dtype": "bfloat16",
        "param_dtype": "bfloat16",
        "attention": "xla",
    }
    # bfloat16's spacing at 1 is 2^-7: 1 + 2^-8 is halfway between 1 and 1 + 2^-7, and
    # 1 + 3 * 2^-8 between 1 + 2^-7 and 1 + 2^-6; ties go to the even significand.
    params = {"w": jnp.asarray([1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8]), "ids": jnp.asarray([1, 2])}
    cast = precision.cast_params(params, dtype="bfloat16")
    assert cast["w"].dtype == jnp.bfloat16 and cast["ids"].dtype == params["ids"].dtype
    assert cast["w"].astype(jnp.float32).tolist() == [1.0, 1.0 + 2.0**-6]


# The engine's scatter of the quickstart's cache is in the KV dtype: a bfloat16 generator's
# state is the float32 one less half of its cache.
def test_kv_cache_follows_the_generator_dtype_in_the_engine_and_the_plan(tiny_cfg):
    config = load_config("quickstart")
    mesh = sharding.make_mesh((2, 2, 2))
    scfg = planner.sampling_config(rl.resolve(config))
    slots, P = config.batch.prompts * config.batch.group_size, scfg.buckets[-1]
    layout = _Layout(mesh, sharding.SAMPLE_RULES)
    states = {}
    for name in ("float32", "bfloat16"):
        cfg = precision.generator_model(tiny_cfg, name)
        graphdef, _ = model.abstract_model(cfg)
        real = generator.Generator(graphdef, cfg, scfg, slots, P, mesh)
        assert {x.dtype for x in real.state.cache.k + real.state.cache.v} == {jnp.dtype(name)}
        states[name] = planner.abstract_engine_state(cfg, scfg, slots, P, layout)
        expected = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(real.state))
        assert planner.device_bytes(states[name]) == expected
    cache = planner.device_bytes(states["float32"].cache.k + states["float32"].cache.v)
    total = {k: planner.device_bytes(v) for k, v in states.items()}
    assert total["bfloat16"] == total["float32"] - cache // 2
    # The generator's params: every leaf is a copy once cast, in its own dtype's bytes.
    _, params = planner.abstract_params(tiny_cfg, mesh, sharding.SAMPLE_RULES)
    _, low = planner.abstract_params(
        precision.generator_model(tiny_cfg, "bfloat16"), mesh, sharding.SAMPLE_RULES
    )
    entries = [{"temp_bytes": 0}]
    same = planner.generator_bytes(params, params, states["float32"], entries, copy=False)
    cast = planner.generator_bytes(params, low, states["bfloat16"], entries, copy=False)
    assert same["generator_params"] == 0
    assert cast["generator_params"] == planner.device_bytes(params) // 2


# ------------------------------------------------------------------------------------------
# The gap: the generator's sampled logprobs against the float32 trainer's recomputation.
# ------------------------------------------------------------------------------------------


def sample_and_rescore(cfg, params, name: str, scfg: SamplingConfig):
    """Completions sampled by the static sampler with the generator of `name`'s numerics, and
    the float32 trainer's logprobs of them (`rl.forward.vocab_token_terms`, the learner's
    math, over the whole rows without a cache): (sampler [N, M], trainer [N, M], mask)."""
    gen_cfg = precision.generator_model(cfg, name)
    gen_graphdef, _ = model.abstract_model(gen_cfg)
    gen_params = params if gen_cfg is cfg else precision.cast_params(params, dtype=name)
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(1, cfg.vocab_size, n)) for n in (5, 9, 16, 3)]
    out = Sampler(gen_graphdef, gen_cfg)(gen_params, prompts, jax.random.key(1), scfg)
    G, P = scfg.num_samples, out.prompt_BP.shape[1]
    tokens = np.concatenate([np.repeat(out.prompt_BP, G, 0), np.asarray(out.tokens)], 1)
    mask = np.concatenate([np.repeat(out.prompt_mask_BP, G, 0), np.asarray(out.mask)], 1)
    graphdef, _ = model.abstract_model(cfg)

    @jax.jit
    def trainer(params, tokens, mask):
        positions = decoder.positions_from_mask(mask)
        h, _ = decoder.hidden(graphdef, params, tokens, positions, mask)
        targets = tokens[:, P:]
        return forward.vocab_token_terms(
            graphdef, params, h[:, P - 1 : -1], targets, scfg, ("logp",)
        )

    logp = np.asarray(trainer(params, tokens, mask)["logp"])
    return np.asarray(out.logprobs), logp, np.asarray(out.mask)


# XLA:CPU converts float16 with the F16C instructions (AVX and later): code generated for SSE4.2
# alone (`--xla_cpu_max_isa=SSE4_2`, an older CPU's) fails to link its conversion kernels.
NO_F16C = "max_isa=SSE" in os.environ.get("XLA_FLAGS", "")


@pytest.mark.parametrize(
    "name",
    [
        "bfloat16",
        pytest.param(
            "float16",
            marks=pytest.mark.skipif(NO_F16C, reason="XLA:CPU's float16 needs F16C (AVX)"),
        ),
    ],
)
def test_low_precision_generator_logprobs_differ_by_its_rounding(tiny_cfg, name):
    """The mean per-token |trainer - generator| logprob gap is a small multiple of the
    generator dtype's unit roundoff u (bfloat16 2^-8, float16 2^-11): its weights are rounded
    to nearest (relative error up to u each) and so is every activation it stores, and a
    logit sums such products over the model width, so it moves by a few u times its O(1)
    magnitude (N(0, 1 / fan_in) weights, unit norms), and logp = logit - logsumexp with it.
    [u / 4, 16 u] holds that with margin on either side (measured: 2.6 u and 2.7 u); the
    float32 generator's gap is of float32's rounding (u = 6e-8: 5e-7), three orders of
    magnitude below the window."""
    params = random_decoder_params(tiny_cfg, 0)
    scfg = SamplingConfig(max_new_tokens=16, num_samples=2, buckets=(16,))
    sampler, trainer, mask = sample_and_rescore(tiny_cfg, params, name, scfg)
    u = float(jnp.finfo(name).eps) / 2
    gap = np.abs(trainer - sampler)[mask].mean()
    assert u / 4 < gap < 16 * u, (name, gap, u)
    assert np.corrcoef(np.exp(trainer[mask]), np.exp(sampler[mask]))[0, 1] < 1.0


# ------------------------------------------------------------------------------------------
# The log-ratio histogram.
# ------------------------------------------------------------------------------------------


def test_log_ratio_histogram_over_chunks_equals_numpy():
    rng = np.random.default_rng(0)
    logp = -rng.exponential(1.0, (16, 32)).astype(np.float32)
    d = (rng.normal(0, 1, logp.shape) * 10.0 ** rng.uniform(-9, 2, logp.shape)).astype(np.float32)
    d[0, :4] = [0.0, 1e-8, -1e-8, 10.0]  # On the limits: each in the bucket it closes.
    sampler = logp - d
    mask = rng.random(logp.shape) < 0.7
    mask[0, :4] = True
    stats = jax.jit(logp_match.logp_match_stats)
    chunks = [stats(logp[r], sampler[r], mask[r]) for r in (slice(0, 5), slice(5, 9), slice(9, 16))]
    hist = logp_match.log_ratio_histogram(chunks)
    # The float32 difference the device computes, bucketed by (limit[i - 1], limit[i]].
    got_d = (logp - sampler)[mask]
    limits = logp_match.LIMITS
    expected = np.array([np.sum((got_d <= hi) & (got_d > lo)) for lo, hi in zip(
        np.concatenate([[-np.inf], limits[:-1]]), limits)])  # fmt: skip
    np.testing.assert_array_equal(hist.counts, expected)
    assert hist.counts.sum() == mask.sum()
    assert (hist.min, hist.max) == (got_d.min(), got_d.max())
    assert hist.sum == pytest.approx(got_d.astype(np.float64).sum(), rel=1e-5, abs=1e-6)
    none = logp_match.log_ratio_histogram([stats(logp, sampler, mask & False)])
    assert none is None


def tensorboard_histograms(workdir) -> dict:
    """{(tag, step): the `HistogramProto`} of WORKDIR/tb's event files (TFRecords: a length,
    its CRC, the `Event`, its CRC)."""
    out = {}
    for path in glob.glob(str(workdir / "tb" / "events.out.tfevents.*")):
        with open(path, "rb") as f:
            while len(head := f.read(12)) == 12:
                data = f.read(struct.unpack("<Q", head[:8])[0])
                f.read(4)
                event = event_pb2.Event.FromString(data)
                for v in event.summary.value:
                    if v.HasField("histo"):
                        out[v.tag, event.step] = v.histo
    return out


def test_histogram_goes_to_tensorboard_only(tmp_path):
    hist = metrics.Histogram(
        limits=np.array([-1.0, 0.0, np.inf]),
        counts=np.array([1, 0, 2]),
        min=-2.0,
        max=3.0,
        sum=1.0,
        sum_squares=13.0,
    )
    writer = metrics.MetricWriter(str(tmp_path))
    record = {"compute/flops": 0.0, "compute/device_seconds": 0.0, "train/loss": 1.0}
    writer.write(1, {**record, "train/log_ratio": hist}, progress=False)
    writer.close()
    assert "train/log_ratio" not in (tmp_path / "metrics.jsonl").read_text()
    h = tensorboard_histograms(tmp_path)["train/log_ratio", 1]
    assert list(h.bucket) == [1, 0, 2] and list(h.bucket_limit)[:2] == [-1.0, 0.0]
    assert (h.num, h.min, h.max, h.sum, h.sum_squares) == (3, -2.0, 3.0, 1.0, 13.0)
