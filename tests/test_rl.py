"""The RL loop: golden metrics, every recipe on the 8-device mesh, data-parallel work read from
the compiled programs, 2 processes == 1 process, rollouts, the defect fixes, bad input."""

import dataclasses
import json
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
from conftest import (
    GOLDEN,
    ROOT,
    golden_config,
    load_config,
    metric_lines,
    rounding,
    subprocess_env,
)

from rlscale import rl
from rlscale.rl import checks, logp_match, rollouts
from rlscale.sampling import SamplingConfig, scoring

RECIPES = ["grpo", "dapo", "drgrpo", "gspo", "cispo", "scalerl", "ppo", "quickstart", "distill"]
# Preference runs (the preference driver): pairs made from the warm start, iterative rounds.
RECIPES += ["dpo", "iterative_dpo"]
# The cispo run samples under a logits transform: the learner's logprobs must follow it (ratio
# exactly 1 before the update), where they used to ignore temperature, top-k and top-p.
SAMPLING = {"cispo": dict(temperature=0.7, top_k=20, top_p=0.9)}


# ------------------------------------------------------------------------------------------
# Golden metrics: recorded before the loop became parts, on another machine; the parts
# reproduce them on any x86-64 machine (checked under XLA_FLAGS=--xla_cpu_max_isa=AVX2 and
# SSE4_2 as well as natively with AVX-512).
# ------------------------------------------------------------------------------------------

# Fields computed in float32 from the params: XLA:CPU adds their sums in an order that follows
# the machine's vector instructions, so their last bits do too. Every other field is exact on
# any machine: steps, prompt ids, counts and fractions of whole numbers (rewards, lengths,
# kept and clipped tokens, FLOPs), all made from the sampled tokens.
ROUNDED = {
    "train/loss", "train/grad_norm", "train/advantage_mean", "train/ratio_mean", "train/kl",
    "train/value_loss", "train/logp_gap_abs", "train/prob_pearson",
}  # fmt: skip


def golden_tolerance(config) -> float:
    """How far a ROUNDED field of `config`'s golden run may move between machines, as a
    fraction of max(|value|, 1).

    Each such value comes from float32 sums of at most 2^16 terms (the largest parameter's
    128 x 384 squared gradients in the gradient norm; a batch's token positions, 64 x at
    most 128 for SFT and 32 x 32 for RL, each through a logsumexp over 256 tokens):
    `rounding(2^16)` = 1.1e-4 each. Every optimizer update from the seeded init (the SFT
    warm start's, then the RL steps') carries such a difference into the params that later
    values are computed from; over a few updates at these learning rates the differences add
    up without growing, which is why the runs are three RL steps long: 23 updates give
    2.5e-3 (quickstart, GRPO), PPO's 32 give 3.4e-3. The terms are O(1) (normalized
    advantages, ratios near 1, logprobs), so a value near 0 is a cancellation and compares
    absolutely: GRPO's loss at ratio 1 is a sum of advantages, 0 up to rounding."""
    learner = config.learner
    updates = config.sft.max_steps + config.steps * learner.minibatches * learner.epochs
    return updates * rounding(2**16)


@pytest.fixture(scope="module")
def golden_runs(warm, shared_workdir):
    """Each golden run's workdir (run on first use, on one device); the warm fixture is the
    quickstart's golden run itself."""

    def run(name, workdir):
        config = golden_config(name)
        config.sft.reuse_from = str(warm)
        rl.run(rl.resolve(config), str(workdir))

    def get(name):
        if name == "quickstart":
            return warm
        return shared_workdir(f"golden_{name}", lambda workdir: run(name, workdir))

    return get


@pytest.mark.isa_sensitive
@pytest.mark.parametrize("name", ["quickstart", "grpo", "ppo"])
def test_golden_metrics(name, golden_runs):
    """Three RL steps reproduce the recorded metrics: exactly, but for the ROUNDED fields,
    which stay within `golden_tolerance`. The sampled tokens, and so every exact field, do
    not follow the last bits: a token changes only where the sampler's draw falls within the
    probabilities' rounding (about 1e-6 relative) of a boundary: a chance of about 1e-6
    for each of the runs' few thousand tokens. Measured: every exact field equal, ROUNDED fields
    within 1.1e-6 of max(|value|, 1), between the machine that recorded them and runs with
    AVX-512, AVX2 and SSE4.2 code. A behaviour change moves far more: with the policy
    gradient's sign flipped (cispo, ppo_clip) the quickstart and PPO fail at step 1 (loss,
    clip fractions) and GRPO at step 3 (its loss at ratio 1 is 0 either way; the tokens
    sampled after two updates differ)."""
    assert_golden(golden_runs(name), name, golden_config(name))


def assert_golden(workdir, name: str, config) -> None:
    """`workdir`'s metrics are `name`'s recorded golden run's: every exact field equal, the
    ROUNDED ones within `golden_tolerance(config)` of max(|value|, 1)."""
    tol = golden_tolerance(config)
    expected = metric_lines(os.path.join(GOLDEN, f"{name}_smoke.jsonl"))
    got = metric_lines(workdir)
    assert [x["step"] for x in got] == [x["step"] for x in expected]
    assert len(got) == config.steps + 1
    for ours, theirs in zip(got, expected):
        assert ours.keys() == theirs.keys(), ours["step"]
        exact = [{k: v for k, v in x.items() if k not in ROUNDED} for x in (ours, theirs)]
        assert exact[0] == exact[1], ours["step"]
        for key in ROUNDED & ours.keys():
            a, b = ours[key], theirs[key]
            assert (a is None) == (b is None), (ours["step"], key, a, b)
            if b is not None:
                assert abs(a - b) <= tol * max(abs(b), 1.0), (ours["step"], key, a, b, tol)


# ------------------------------------------------------------------------------------------
# Every recipe, on the default mesh (8 devices: the batch split 8 ways).
# ------------------------------------------------------------------------------------------


# Recipes whose runs the program tests below read: three steps and two evaluations (at steps
# 2 and 3). The others run two steps: a step after the first runs the programs it compiled.
THREE_STEPS = ("quickstart", "grpo")


def _recipe_config(name, warm):
    base, _, variant = name.partition(":")
    config = load_config(base, ",".join(filter(None, ["smoke", variant])))
    config.steps = 3 if name in THREE_STEPS else 2
    config.sampling.update(SAMPLING.get(name, {}))
    config.sft.reuse_from = str(warm)
    return config


def recipe_workdir(name, warm, shared_workdir):
    """`name`'s recipe run (`_recipe_config`), made once in the session: its config and
    workdir. tests/test_notebook.py asks for the quickstart's and GRPO's too: its kernel loads
    their compiled programs from the compilation cache."""
    config = _recipe_config(name, warm)
    workdir = shared_workdir(
        "recipe_" + name.replace(":", "_").replace("=", "_"),
        lambda workdir: rl.run(rl.resolve(config), str(workdir)),
    )
    return config, workdir


@pytest.fixture(scope="module")
def recipe_runs(warm, shared_workdir):
    """Each recipe's smoke run (run on first use), reusing the warm start: its config, summary
    and workdir."""

    def get(name):
        config, workdir = recipe_workdir(name, warm, shared_workdir)
        with open(workdir / "summary.json") as f:
            return config, json.load(f), workdir

    return get


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_runs(name, recipe_runs):
    config, summary, workdir = recipe_runs(name)
    lines = metric_lines(workdir)
    assert [x["step"] for x in lines] == list(range(config.steps + 1))
    train = lines[1:]
    assert all(np.isfinite(x["train/loss"]) for x in train if x["train/loss"] is not None)
    # Sampler == learner on the first minibatch's trained tokens; null where it has none (the
    # zero-variance filter can drop every group there).
    gaps = [x["train/logp_gap_abs"] for x in train if x["train/logp_gap_abs"] is not None]
    assert max(gaps, default=0.0) < 1e-4
    assert summary["compute/flops"] > 0
    if name == "ppo":
        assert "train/value_loss" in train[0]
    if name in SAMPLING:  # No filter: every step reports.
        assert len(gaps) == len(train) and max(gaps) < 1e-5
        assert all(abs(x["train/prob_pearson"] - 1.0) < 1e-5 for x in train)
        assert abs(train[0]["train/ratio_mean"] - 1.0) < 1e-5  # One minibatch: on policy.
    if name == "distill":  # Its teacher is its own warm start ("self"), frozen.
        assert all(np.isfinite(x["train/reverse_kl"]) for x in train)
        # The first batch is sampled by the teacher's own params: zero up to the numerics.
        assert abs(train[0]["train/reverse_kl"]) < 1e-5, train[0]["train/reverse_kl"]
        names = [e["name"] for e in json.load(open(workdir / "programs.json"))]
        # One teacher program per shape of the batch, as the update (one sequence per row).
        assert names.count("teacher_logp") == names.count("update_step")


def _program(workdir):
    """The update program of the run's first length bucket."""
    entries = [e for e in json.load(open(workdir / "programs.json")) if e["name"] == "update_step"]
    assert entries, "no update_step in programs.json"
    return entries[0]


def test_learner_is_data_parallel(golden_runs, recipe_runs):
    """The same config on 8 devices: each does an eighth of the 1-device learner's work (the
    update, with GRPO's no-gradient reference pass), bucket for bucket."""
    for recipe in ("quickstart", "grpo"):
        workdir = recipe_runs(recipe)[2]
        one, eight = _program(golden_runs(recipe)), _program(workdir)
        assert one["devices"] == 1 and eight["devices"] == 8
        assert eight["mesh_shape"] == {"data": 8, "fsdp": 1, "tensor": 1}
        ratio = eight["flops_per_device"] / (one["flops_per_device"] / 8)
        assert 0.8 < ratio < 1.2, (recipe, one["flops_per_device"], eight["flops_per_device"])
    for entry in json.load(open(workdir / "programs.json")):
        assert entry["flops_per_device"] > 0 and entry["argument_bytes"] > 0
        assert {"bytes_accessed_per_device", "output_bytes", "temp_bytes"} <= set(entry)


def test_one_program_per_shape(recipe_runs):
    """Three steps and two evaluations compile the update once per length bucket the steps
    used: the state it returns is laid out as the one it was given."""
    for recipe in ("quickstart", "grpo"):
        workdir = recipe_runs(recipe)[2]
        names = [e["name"] for e in json.load(open(workdir / "programs.json"))]
        buckets = {x["train/length_bucket"] for x in metric_lines(workdir)[1:]}
        assert names.count("update_step") == len(buckets), (recipe, names, buckets)


# ------------------------------------------------------------------------------------------
# Several processes: 2 processes x 4 devices == 1 process x 8 devices, and the checkpoint of
# the former resumes under the latter.
# ------------------------------------------------------------------------------------------


def _launch(workdir, processes, steps, warm):
    """`processes` processes x 4 / processes devices. A 1-process run joins a 1-process job
    too, so both sides sum across devices with the same collectives (gloo): XLA's in-process
    CPU all-reduce adds in another order, which moves the last bits of a sum."""
    port = 20000 + (os.getpid() + 97 * processes + steps) % 20000
    env = subprocess_env(
        4 // processes,
        JAX_COORDINATOR_ADDRESS=f"localhost:{port}",
        JAX_NUM_PROCESSES=str(processes),
        JAX_INITIALIZATION_TIMEOUT="60",
    )
    command = [
        sys.executable, "-m", "rlscale.main",
        "--config", os.path.join(ROOT, "configs", "quickstart.py") + ":smoke",
        "--workdir", str(workdir),
        f"--config.steps={steps}",
        "--config.checkpoint.every=1",
        "--config.reward.fn=reward_fixtures:even_length",
        "--config.reward.workers=0",
        f"--config.sft.reuse_from={warm}",
    ]  # fmt: skip
    procs = [
        subprocess.Popen(
            command,
            env={**env, "JAX_PROCESS_ID": str(i)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(processes)
    ]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    return outs


def test_two_processes_equal_one_and_resume_under_one(warm, tmp_path):
    """Two launches: two processes for 2 steps (checkpoints at steps 1 and 2), then the step-1
    checkpoint, in a copy of the workdir, resumed by one process to step 2: its step 2 is the
    two processes' step 2 exactly (line and checkpoint). Each step is the same function of
    the state it starts from (a run equals its resume, tests/test_reliability.py), so one step
    from the same state is what "2 processes == 1 process" comes to; the checkpoint written by
    two processes is restored (its fingerprints checked) by one."""
    two, one = tmp_path / "two", tmp_path / "one"
    _launch(two, 2, 2, warm)
    shutil.copytree(two, one)
    shutil.rmtree(one / "checkpoints" / "2")  # As a run killed during step 2 leaves it.
    reference = metric_lines(two)
    assert reference[2]["train/reward_mean"] is not None  # Step 2 trained.
    _, err = _launch(one, 1, 2, warm)[0]
    assert "resuming from the checkpoint at step 1" in err
    assert metric_lines(one) == reference
    # The two checkpoints of step 2 hold the same state: every array's fingerprint agrees.
    meta = [json.load(open(d / "checkpoints" / "2" / "meta" / "metadata")) for d in (one, two)]
    assert meta[0]["arrays"] == meta[1]["arrays"] and len(meta[0]["arrays"]) > 10


def _main_with_env(tmp_path, **env):
    return subprocess.run(
        [sys.executable, "-m", "rlscale.main", "--config", "configs/quickstart.py:smoke",
         "--workdir", str(tmp_path)],
        env=dict(os.environ, JAX_PLATFORMS="cpu", **env),
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


@pytest.mark.slow
def test_process_count_mismatch_fails_naming_it(tmp_path):
    r = _main_with_env(
        tmp_path, JAX_COORDINATOR_ADDRESS="localhost:1", JAX_NUM_PROCESSES="2", JAX_PROCESS_ID="2"
    )
    assert r.returncode != 0
    assert "JAX_PROCESS_ID=2 is not below JAX_NUM_PROCESSES=2" in r.stderr


@pytest.mark.slow
def test_processes_that_never_join_fail_naming_the_count(tmp_path):
    r = _main_with_env(
        tmp_path,
        JAX_COORDINATOR_ADDRESS=f"localhost:{20000 + os.getpid() % 20000 + 7}",
        JAX_NUM_PROCESSES="2",
        JAX_PROCESS_ID="1",  # Process 0, the coordinator, is never started.
        JAX_INITIALIZATION_TIMEOUT="3",
    )
    assert r.returncode != 0
    assert "error: no coordinator at localhost:" in r.stderr
    assert "JAX_NUM_PROCESSES must match the number of processes launched" in r.stderr


# ------------------------------------------------------------------------------------------
# Rollouts.
# ------------------------------------------------------------------------------------------


def _samples(rewards, *, forced=None, lengths=None):
    """Scored samples of len(rewards) // 2 prompts x 2, completions of 4 tokens."""
    N = len(rewards)
    mask = np.ones((N, 4), bool)
    return scoring.Samples(
        prompt_BP=np.full((N // 2, 3), 5),
        prompt_mask_BP=np.ones((N // 2, 3), bool),
        tokens_NM=np.full((N, 4), 7),
        mask_NM=mask,
        logprobs_NM=np.full((N, 4), -1.0, np.float32),
        forced_NM=np.zeros((N, 4), bool) if forced is None else forced,
        lengths_N=np.full(N, 4) if lengths is None else np.asarray(lengths),
        truncated_N=np.zeros(N, bool),
        interrupted_N=np.zeros(N, bool),
        texts=["x"] * N,
        reward_N=np.asarray(rewards, float),
        failures={"error": 0},
    )


class _Source(rollouts.RolloutSource):
    """A RolloutSource over canned samples (no sampler)."""

    def __init__(self, config, samples):
        from rlscale.data import filters

        super().__init__(
            config.batch, config.filters, config.pipeline.decode_chunk, None, scoring_cfg(), None,
            list(range(100)), None,
            filters.PromptStream(100), filters.PassRateHistory(),
        )  # fmt: skip
        self._samples = list(samples)

    def _sample(self, params, ids, rng, version):
        s = self._samples.pop(0)
        s.versions_NM = np.full(s.tokens_NM.shape, version)
        return s


def scoring_cfg():

    return SamplingConfig(max_new_tokens=4, num_samples=2, pad_id=0)


def _config(**filters):
    c = load_config("dapo")
    c.batch.prompts, c.batch.group_size, c.sampling.max_new_tokens = 2, 2, 4
    c.filters.dynamic_sampling, c.filters.overlong_cache = False, 0
    c.filters.update(filters)
    return c


def test_forced_tokens_are_context_not_actions():
    forced = np.zeros((4, 4), bool)
    forced[0, 1:3] = True
    roll, _ = _Source(_config(), [_samples([1.0, 0.0, 1.0, 0.0], forced=forced)]).next(
        None, jax.random.key(0), version=3
    )
    assert roll.mask_NM.tolist() == (~forced).tolist()
    assert roll.attn_mask_NL[:, 3:].all()  # Still in attention.
    assert (roll.version_NM == 3).all()


def test_filters_judge_correctness_not_the_shaped_reward():
    """DAPO keeps a group when 0 < #correct < G. An all-correct group in which one completion
    is overlong has reward spread (the penalty) but nothing to learn about correctness."""
    config = _config(zero_variance=True, overlong_cache=2)
    # Prompt 0: both correct, one overlong (length 4 of 4 with a cache of 2: penalty -1).
    # Prompt 1: one correct, one wrong.
    samples = _samples([1.0, 1.0, 1.0, 0.0], lengths=[2, 4, 2, 2])
    roll, stats = _Source(config, [samples]).next(None, jax.random.key(0), version=0)
    assert stats["reward"].tolist() == [1.0, 0.0, 1.0, 0.0]  # 1 + (2 - 4) / 2 for row 1.
    assert stats["kept_prompts"] == 1 and stats["filtered_prompts"] == 1
    # The kept group (prompt 1) comes first; prompt 0 rides along with weight 0.
    assert roll.row_weight_N.tolist() == [1.0, 1.0, 0.0, 0.0]
    assert roll.correct_N.tolist() == [True, False, True, True]


def test_dynamic_sampling_draws_until_the_batch_is_full():
    config = _config(dynamic_sampling=True, dynamic_max_rounds=3)
    rounds = [_samples([1.0, 1.0, 0.0, 1.0]), _samples([0.0, 0.0, 1.0, 0.0])]
    roll, stats = _Source(config, rounds).next(None, jax.random.key(0), version=0)
    assert stats["rounds"] == 2 and stats["kept_prompts"] == 2
    assert roll.row_weight_N.tolist() == [1.0] * 4
    assert roll.reward_N.tolist() == [0.0, 1.0, 1.0, 0.0]  # Round 1's kept, then round 2's.


# ------------------------------------------------------------------------------------------
# The learner: ratios against the generator, and its logprob match with the generator.
# ------------------------------------------------------------------------------------------


# Compiled as the update compiles it (inside its jit): one program per chunk shape, where
# calling it op by op compiled each of its operations for each shape (3.1 -> 1.3 CPU-s).
_stats = jax.jit(logp_match.logp_match_stats)


@pytest.mark.parametrize(
    "scale,noise,tol",
    [
        (1.0, 0.3, 1e-5),
        # Probabilities near 0.99: raw float32 sums of x^2 lose the variance (r off by ~1e-3).
        (0.01, 1e-4, 1e-6),
    ],
)
def test_logp_match_over_chunks_equals_numpy(scale, noise, tol):
    rng = np.random.default_rng(0)
    logp = -rng.exponential(scale, (64, 32)).astype(np.float32)
    sampler_logp = (logp + rng.normal(0, noise, logp.shape)).astype(np.float32)
    mask = rng.random(logp.shape) < 0.7
    mask[10:12] = False  # A chunk without tokens.
    sampler_logp[~mask] = -np.inf  # What padding holds must not reach the statistics.
    x, y = np.exp(logp[mask].astype(np.float64)), np.exp(sampler_logp[mask].astype(np.float64))
    expected = {
        "train/logp_gap_abs": np.abs(logp - sampler_logp)[mask].astype(np.float64).mean(),
        "train/prob_pearson": np.corrcoef(x, y)[0, 1],
    }
    for cuts in ([], [3, 10, 12, 40]):  # One chunk, and five uneven ones.
        chunks = [_stats(logp[r], sampler_logp[r], mask[r]) for r in np.split(np.arange(64), cuts)]
        got = logp_match.logp_match(chunks)
        assert got.keys() == expected.keys()
        assert got["train/logp_gap_abs"] == pytest.approx(expected["train/logp_gap_abs"], rel=1e-5)
        assert got["train/prob_pearson"] == pytest.approx(expected["train/prob_pearson"], abs=tol)
    none = logp_match.logp_match([_stats(logp, sampler_logp, mask & False)])
    assert all(np.isnan(v) for v in none.values())  # Undefined without tokens: null.


# ------------------------------------------------------------------------------------------
# Bad input fails at start-up naming the key.
# ------------------------------------------------------------------------------------------


def test_bad_config_lists_every_problem():
    config = load_config("ppo")
    config.objective.chain = "gae | token_ratio | cispoo | aggregate(mode=token_mean)"
    config.batch.prompts = 6
    config.learner.minibatches = 4
    config.learner.logprob_chunk = 0
    config.learner.remat = "dot"
    config.learner.pack_rows = -1
    config.batch.prompt_pool = 5
    with pytest.raises(ValueError) as e:
        rl.resolve(config)
    text = str(e.value)
    assert "learner.pack_rows=-1 must be an integer >= 0" in text
    config = load_config("grpo")
    config.objective.chain = "process_advantages | token_ratio | cispo | aggregate(mode=token_mean)"
    with pytest.raises(ValueError, match=r"reads step_reward \(process_advantages\) but reward"):
        rl.resolve(config)
    assert "batch.prompt_pool=5 must be 0 (every training prompt) or at least batch.prompts" in text
    assert "objective.chain: unknown transform 'cispoo'" in text and "cispo" in text
    assert "batch.prompts=6 is not divisible by learner.minibatches=4" in text
    assert "learner.logprob_chunk=0 must be an integer >= 1" in text
    assert "learner.remat='dot' is not one of ('none', 'dots', 'full')" in text
    config = load_config("grpo")
    config.objective.chain = "group_advantages | cispo(eps_max=4.0) | aggregate(mode=token_mean)"
    with pytest.raises(ValueError, match="cispo needs term 'ratio'"):
        rl.resolve(config)


def test_packing_that_cannot_hold_the_data_fails_at_start_up():
    """Checked against the longest training prompt before the warm start: a row of 96
    tokens holds a 16 + 32-token sequence, not a 70 + 32-token one. Any `pack_rows` holds
    the data (below a group's need a micro-batch holds part of one)."""
    config = load_config("quickstart", "")
    run = rl.resolve(config)

    def problems(longest, run=run, **learner):
        u = dataclasses.replace(run.learner, **learner)
        return checks.pack_problems(u, run.batch, run.sampling, longest)

    assert problems(16) == []
    assert "its prompt has 70 tokens" in problems(70)[0]
    assert problems(16, pack_rows=1) == problems(16, pack_rows=3) == []
    one_per_row = rl.resolve(load_config("quickstart"))
    assert problems(70, one_per_row) == problems(16, one_per_row, pack_rows=1) == []


def test_mesh_that_does_not_divide_the_batch_fails_naming_it():
    config = load_config("quickstart")
    config.mesh.shape = (8, 1, 1)
    config.batch.prompts = 12  # 12 prompts over 8 data shards.
    config.learner.minibatches = 1
    with pytest.raises(ValueError) as e:
        rl.resolve(config)
    assert "batch.prompts=12 is not divisible by the mesh's batch axes" in str(e.value)
    assert "mesh.shape=(8, 1, 1)" in str(e.value)
    config.mesh.shape = (3, 1, 1)
    with pytest.raises(ValueError, match=r"mesh.shape=\(3, 1, 1\) does not fit 8 devices"):
        rl.resolve(config)


def test_prompt_pool_larger_than_the_training_set_fails_before_the_warm_start(tmp_path):
    config = load_config("quickstart", "smoke")
    config.batch.prompt_pool = config.task.n_train + 1
    with pytest.raises(ValueError, match=r"batch.prompt_pool=201 is more than the task's 200"):
        rl.setup.build(rl.resolve(config), str(tmp_path))
    assert not os.path.exists(tmp_path / "sft")  # Nothing trained.
