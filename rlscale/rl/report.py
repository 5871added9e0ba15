"""What a run reports: compute accounting (model FLOPs by the 2N-per-token forward convention,
device-seconds), the per-step metrics record, and the files a finished run leaves.

Dimension letters: N rows, L = P + M tokens, M completion tokens, O optimizer steps per batch, U
micro-batches per step.
"""

import json
import os

import jax
import numpy as np

from rlscale import checkpoint, optim
from rlscale.envs import episodes as env_episodes
from rlscale.model import hf, lora
from rlscale.rl import batch_layout, learned_rewards, logp_match
from rlscale.scaling import compute


class Compute:
    """The run's compute counters (checkpointed as host state)."""

    KEYS = ("compute/sample_flops", "compute/train_flops", "compute/device_seconds")

    def __init__(self, counters: dict | None = None, *, max_new_tokens=0, epochs=1, layout=None):
        """`layout`: the learner's (`batch_layout.Layout`), whose `shared_prefix` runs a
        group's prompt once (None: every row's tokens)."""
        self.counters = counters if counters is not None else dict.fromkeys(self.KEYS, 0.0)
        self.max_new_tokens, self.epochs, self.layout = max_new_tokens, epochs, layout

    def add_step(self, model_cfg, stats, rollouts, passes):
        """One step's FLOPs: sampling (prompts + generated tokens + an environment's reply
        tokens, and a learned reward's forward passes over them, `scoring_flops`), the
        learner's `passes` no-grad forward passes (the trainer's old terms, the reference's)
        and its training passes."""
        generated = float(stats["lengths"].sum()) + stats["env_tokens"]
        self.add_sampling(model_cfg, stats["prompt_tokens"] + generated, rollouts.prompt_len)
        self.counters["compute/sample_flops"] += stats["scoring_flops"]
        self.add_training(model_cfg, rollouts, passes)

    def add_sampling(self, model_cfg, tokens: float, prompt_len: int):
        """Sampling FLOPs: a forward pass over `tokens` (the prompts' tokens, once per prompt,
        plus the generated ones) at the mean context of prompts padded to `prompt_len` and
        half the completion budget."""
        ctx = prompt_len + self.max_new_tokens / 2
        self.counters["compute/sample_flops"] += compute.forward_flops(model_cfg, tokens, ctx)

    def add_training(self, model_cfg, rollouts, passes):
        """The learner's FLOPs on a batch: `passes` no-grad forward passes (the trainer's old
        terms, the reference's) and `epochs` training passes over its sequences' tokens (with
        a shared prefix, a group's prompt once: `batch_layout.forward_tokens`)."""
        ctx = rollouts.prompt_len + self.max_new_tokens / 2
        seq_tokens = float(rollouts.attn_mask_NL.sum())
        if self.layout is not None:
            seq_tokens = float(batch_layout.forward_tokens(rollouts, self.layout))
        self.counters["compute/train_flops"] += (
            compute.forward_flops(model_cfg, seq_tokens, ctx) * passes
            + compute.train_flops(model_cfg, seq_tokens, ctx) * self.epochs
        )

    def add_seconds(self, seconds: float, devices: int):
        self.counters["compute/device_seconds"] += seconds * devices

    def metrics(self) -> dict:
        c = self.counters
        return {**c, "compute/flops": c["compute/sample_flops"] + c["compute/train_flops"]}


def learner_means(learner_metrics, *, match: bool = True) -> tuple[float, dict]:
    """(The batch's loss, the learner's other metrics as means over its optimizer steps and
    micro-batches). With `match`, the sampler-vs-learner logprob match of the first step
    (`logp_match.logp_match`) and its per-token log-ratio histogram (`train/log_ratio`, a
    `metrics.Histogram`, where it has tokens); without (rows no sampler wrote), none."""
    mets = jax.tree.map(np.asarray, dict(learner_metrics))  # Per step [O] or micro-batch [O, U].
    loss_sum = float(np.sum(mets.pop("train/loss_sum")))
    denom = float(np.sum(mets.pop("train/denominator")))
    ran = mets.pop("train/micro_ran", None)  # Packed: [O, U], the micro-batches each step ran.
    stats = mets.pop("train/logp_match_stats", None)
    matched = {}
    if match and stats is not None:  # The first step's micro-batches -> gap, Pearson r.
        first = len(stats["n"][0]) if ran is None else int(ran[0].sum())
        chunks = [{k: v[0, u] for k, v in stats.items()} for u in range(first)]
        matched = logp_match.logp_match(chunks)
        hist = logp_match.log_ratio_histogram(chunks)
        if hist is not None:
            matched["train/log_ratio"] = hist
    if ran is not None:  # Per micro-batch metrics past a step's count are zeros: left out.
        mets = {k: v[ran] if np.shape(v) == ran.shape else v for k, v in mets.items()}
    # A batch whose every group was filtered runs no micro-batch: its metrics are 0, as its
    # loss is (no token contributes to either).
    means = {k: float(np.mean(v, dtype=np.float64)) if np.size(v) else 0.0 for k, v in mets.items()}
    return loss_sum / max(denom, 1.0), {**means, **matched}


def step_record(stats, learner_metrics, *, retired, skipped, times) -> dict:
    """The metrics line of one RL step (before evaluation and compute counters); with the
    step's seconds (`time/step_s`), the generated tokens per second (`time/tokens_per_s`)."""
    loss, means = learner_means(learner_metrics)
    if "time/step_s" in times:  # Generated tokens kept for training, per second of the step.
        times = {**times, "time/tokens_per_s": float(stats["lengths"].sum()) / times["time/step_s"]}
    return {
        **samples_record(stats),
        "train/loss": loss,
        "train/kept_prompts": stats["kept_prompts"],
        "train/filtered_prompts": stats["filtered_prompts"],
        "train/sampling_rounds": stats["rounds"],
        "train/retired_prompts": retired,
        "train/newly_retired": stats["newly_retired"],
        "train/skipped_updates": skipped,
        **times,
        **means,
    }


def samples_record(stats) -> dict:
    """What a step's samples were (`stats` of `RolloutSource.rollouts` or of
    `pairs.sample_pairs`): their rewards, pass rate, lengths (the policy's tokens), the
    prompts sampled and the verifier's failures; and, for multi-turn episodes, how they went
    (`episode_record`)."""
    failures = stats["failures"]
    episodes = stats.get("episodes")  # Only RL rollouts of a multi-turn environment.
    return {
        **({} if episodes is None else episode_record(episodes)),
        "train/reward_mean": float(stats["reward"].mean()),
        "train/pass_rate": float(stats["correct"].mean()),
        "train/response_length": float(stats["lengths"].mean()),
        "train/truncated_frac": float(np.mean(stats["truncated"])),
        "train/interrupted_frac": float(np.mean(stats["interrupted"])),
        "data/prompt_ids": [int(i) for i in stats["prompt_ids"]],  # Every prompt sampled.
        "reward/failures": sum(failures.values()),
        **{f"reward/failures_{kind}": n for kind, n in failures.items()},
    }


def episode_record(episodes: dict) -> dict:
    """The `env/` metrics of a step's episodes (per sample, `envs.episodes.Episode.stats`):
    mean policy turns, mean `Environment.step` calls, the fraction of episodes with any, each
    `Reply.info` counter summed over the episodes, and the fraction that ended for each reason
    (`episodes.END_REASONS`); and the seconds spent in those calls, summed (`time/env_s`:
    wall-clock, as every `time/` field)."""
    record = {
        f"env/{k.removeprefix('info/')}": float(v.sum())
        for k, v in episodes.items()
        if k.startswith("info/")
    }
    calls = episodes["calls"]
    record.update(
        {
            "env/turns_mean": float(episodes["turns"].mean()),
            "env/calls_per_episode": float(calls.mean()),
            "env/episodes_with_calls": float((calls > 0).mean()),
            "time/env_s": float(episodes["seconds"].sum()),
        }
    )
    for reason in env_episodes.END_REASONS:
        record[f"env/ended_{reason}"] = float((episodes["end"] == reason).mean())
    return record


def pair_record(sampled, pair_set, pair_ids, learner_metrics, *, skipped, times) -> dict:
    """The metrics line of one preference step (before evaluation and compute counters).

    The pairs in force (`pairs.PairSet`): `pref/pairs`, and where they were sampled
    `pref/round_prompts` and `pref/prompts_without_pair`, `pref/round` for iterative rounds;
    the step's pairs (`pref/batch_pairs`, `data/pair_ids`) and the epochs drawn over them
    (`pref/epochs`); on a step that sampled a round (`sampled`: `pairs.sample_pairs`'s
    stats), its samples as an RL step reports them; and the learner's metrics (the loss, the
    preference transform's implicit rewards and pair accuracy); a step with no pair to train
    on (`learner_metrics` empty) has a null loss. The rows carry no sampler logprobs, so the
    sampler-vs-learner match (`train/logp_gap_abs`, `train/prob_pearson`) is undefined: null.
    """
    stats = pair_set.stats
    record = samples_record(sampled) if sampled is not None else {}
    record["pref/pairs"] = stats["pairs"]
    if "prompts" in stats:
        record["pref/round_prompts"] = stats["prompts"]
        record["pref/prompts_without_pair"] = stats["prompts_without_pair"]
    if pair_set.round >= 0:
        record["pref/round"] = pair_set.round
    record.update(
        {
            "pref/batch_pairs": len(pair_ids),
            "pref/epochs": pair_set.epochs(),
            "data/pair_ids": [int(i) for i in pair_ids],
            "train/skipped_updates": skipped,
            **times,
        }
    )
    record["train/loss"] = float("nan")
    if learner_metrics:
        loss, means = learner_means(learner_metrics, match=False)
        record.update({"train/loss": loss, **means})
    return {**record, **dict.fromkeys(("train/logp_gap_abs", "train/prob_pearson"), float("nan"))}


def staleness(rollouts, version: int) -> dict:
    """How far behind the trainer (at `version`) the trained tokens were sampled, in optimizer
    updates: mean and max per token, split into the part that passed while the sequence was
    generated (in flight: its last token's version minus this token's) and while it waited to
    be trained (in queue: `version` minus its last token's); and the spread of versions."""
    m = rollouts.mask_NM
    if not m.any():
        return dict.fromkeys(STALENESS_KEYS, 0.0)
    v = rollouts.version_NM.astype(np.int64)
    last_N = np.where(m, v, np.iinfo(np.int64).min).max(axis=1, keepdims=True)
    lag = (version - v)[m]
    return {
        "pipeline/staleness_mean": float(lag.mean()),
        "pipeline/staleness_max": int(lag.max()),
        "pipeline/staleness_in_flight_mean": float((last_N - v)[m].mean()),
        "pipeline/staleness_in_queue_mean": float(
            np.broadcast_to(version - last_N, m.shape)[m].mean()
        ),
        "pipeline/version_spread": int(v[m].max() - v[m].min()),
    }


STALENESS_KEYS = (
    "pipeline/staleness_mean",
    "pipeline/staleness_max",
    "pipeline/staleness_in_flight_mean",
    "pipeline/staleness_in_queue_mean",
    "pipeline/version_spread",
)


def generator_record(before, after) -> dict:
    """The generator engine between two `EngineStats` snapshots: its busy seconds (decode,
    prefill, weight swaps), weight-swap seconds and slot utilization (tokens generated per
    slot-step; NaN, written as null, when it decoded nothing in between); with parking rows,
    the samples parked in between; once a paged cache has preempted (`sampling.kv_preempt`),
    the samples preempted in between and the seconds their keys and values took to the host
    and back."""
    busy = lambda e: e.decode_s + e.prefill_s + e.swap_s + e.preempt_s  # noqa: E731
    slot_steps = after.slot_steps - before.slot_steps
    tokens = after.tokens - before.tokens
    record = {
        "time/generator_busy_s": busy(after) - busy(before),
        "time/weight_swap_s": after.swap_s - before.swap_s,
        "pipeline/slot_utilization": tokens / slot_steps if slot_steps else float("nan"),
    }
    if after.parking_rows:
        record["pipeline/parked"] = after.parked - before.parked
    if after.preempted:
        record["pipeline/preempted"] = after.preempted - before.preempted
        record["time/preempt_s"] = after.preempt_s - before.preempt_s
    return record


def trained_record(train) -> dict:
    """What the learner trains and what its optimizer holds (`train`: a `TrainState`): the
    trained params (with LoRA the adapters) and the value head, and the bytes of each and of
    the optimizer state (`optim.tree_bytes`). Logged at start-up and in `summary.json`."""
    trained = (train.params, train.value_params)
    return {
        "train/trained_params": sum(x.size for x in jax.tree.leaves(trained)),
        "train/trained_bytes": optim.tree_bytes(trained),
        "train/opt_state_bytes": optim.tree_bytes(train.opt_state),
    }


def finish(setup, run_state, comp: Compute, workdir: str, wall_s: float) -> dict:
    """The run's summary; writes the final params (and, for a run from a Hugging Face
    checkpoint, a Hugging Face export with the tokenizer and the sampler's stop tokens),
    `summary.json` and `programs.json` (every compiled program's per-device cost). With
    LoRA the final params are merged, and the adapters are also written in PEFT's format
    (WORKDIR/adapter)."""
    evals = run_state.evals
    summary = {
        "start/eval_pass@1": evals[0]["eval/pass@1"],
        "end/eval_pass@1": evals[-1]["eval/pass@1"],
        "start/eval_reward_mean": evals[0]["eval/reward_mean"],
        "end/eval_reward_mean": evals[-1]["eval/reward_mean"],
        **{f"sft/{k}": v for k, v in setup.warm_start_summary.items()},
        **learned_rewards.summary(workdir),
        **comp.metrics(),
        **trained_record(run_state.train),
        "wall_s": wall_s,
    }
    params = setup.policy_params(run_state.train.params)
    checkpoint.save_params(os.path.join(workdir, "final"), setup.model_cfg, params)  # Every host.
    hf_init = setup.config.init.hf_checkpoint
    if jax.process_index() == 0:
        if hf_init:  # Also as a Hugging Face checkpoint that stops where the sampler stops.
            export = os.path.join(workdir, "hf")
            hf.save_hf(
                export,
                setup.model_cfg,
                params,
                tokenizer=setup.tokenizer,
                stop_tokens=setup.scfg.stop_tokens,
            )
        if setup.config.lora.enabled:
            base = setup.base_identity["source"]
            lora.save_peft(
                os.path.join(workdir, "adapter"), run_state.train.params, setup.config.lora, base
            )
        with open(os.path.join(workdir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        setup.programs.write(os.path.join(workdir, "programs.json"))
    return summary
