"""Preference pairs as learner batches (rows 2p chosen, 2p + 1 rejected): from a file, from the warm
start's samples (sampled at set-up, a stage of the run's cache: `stage_cache.PREFERENCE_PAIRS`)
or from each round's; and their resumable draw (`PairSet`).

Dimension letters: B pairs, G samples per prompt, N = 2B rows, P padded prompt length, M completion
tokens.
"""

import dataclasses
import hashlib
import json
import os
import time
from typing import NamedTuple

import jax
import numpy as np

from rlscale import sharding, stage_cache, warm_start
from rlscale.data import filters, preferences
from rlscale.data.preferences import Pair
from rlscale.rl import rollouts
from rlscale.tokenizers import chat

# `preference.file` naming pairs the run samples from its warm start at set-up, cached in
# the stage `stage_cache.PREFERENCE_PAIRS` (PAIRS_FILE, in the stage's directory).
SAMPLE_AT_SETUP = "sample_at_setup"
PAIRS_FILE = "pairs.jsonl"


class TokenPair(NamedTuple):
    """A pair as token ids: the prompt's (as the sampler is given it) and each completion's
    (its last token a stop token unless cut at `sampling.max_new_tokens`)."""

    prompt: tuple[int, ...]
    chosen: tuple[int, ...]
    rejected: tuple[int, ...]


def digest(token_pairs) -> str:
    """A fingerprint of token pairs, in order."""
    h = hashlib.sha256()
    for p in token_pairs:
        h.update(json.dumps([list(p.prompt), list(p.chosen), list(p.rejected)]).encode())
    return h.hexdigest()[:16]


def read_file(preference, tokenizer, scfg) -> tuple[list[TokenPair], list[str]]:
    """(The pairs of `preference.file` (`rl.dpo.PreferenceConfig`), encoded; problems naming
    the key): its malformed rows (each by file and line, from `read_pairs`, which also drops
    ties with one warning) and prompts longer than the largest sampling bucket. No pairs and
    no problems for a run without a file, or with pairs it makes itself (those are read by
    `PairSource.start`)."""
    path = preference.file
    if not path or path == SAMPLE_AT_SETUP:
        return [], []
    try:
        pairs = preferences.read_pairs(path)
    except (OSError, ValueError) as e:
        return [], [f"preference.file={path!r}: {e}"]
    token_pairs, problems = encode_pairs(pairs, tokenizer, scfg)
    return token_pairs, [f"preference.file={path!r}: {p}" for p in problems]


def encode_pairs(pairs, tokenizer, scfg) -> tuple[list[TokenPair], list[str]]:
    """Text pairs as token pairs, encoded as a sampled row is (see the module docstring), and
    the pairs whose prompt is longer than the largest sampling bucket (the first five named
    by `Pair.source`)."""
    M, stops = scfg.max_new_tokens, scfg.stop_tokens

    def completion(text):
        ids = tokenizer.encode(text)
        if not ids or ids[-1] not in stops:
            ids = ids + [stops[0]]
        return tuple(ids[:M])

    out = [
        TokenPair(
            tuple(chat.encode_prompt(tokenizer, p.prompt)),
            completion(p.chosen),
            completion(p.rejected),
        )
        for p in pairs
    ]
    longest = scfg.buckets[-1]
    long = [p.source for p, t in zip(pairs, out) if len(t.prompt) > longest]
    if not long:
        return out, []
    named = ", ".join(long[:5]) + (", ..." if len(long) > 5 else "")
    return out, [
        f"{len(long)} prompts are longer than the largest prompt bucket ({longest} tokens, "
        f"sampling.buckets={tuple(scfg.buckets)}): {named}"
    ]


def pair_rollouts(token_pairs, scfg) -> rollouts.Rollouts:
    """The learner batch of `token_pairs`: rows 2p (chosen) and 2p + 1 (rejected) of pair p,
    prompts left-padded to the bucket of the longest, completions right-padded to
    `sampling.max_new_tokens` (see the module docstring)."""
    M = scfg.max_new_tokens
    P = scfg.bucket(max(len(p.prompt) for p in token_pairs))
    N = 2 * len(token_pairs)
    tokens_NL = np.full((N, P + M), scfg.pad_id, np.int32)
    attn_NL = np.zeros((N, P + M), bool)
    for p, pair in enumerate(token_pairs):
        prompt = pair.prompt
        for row, ids in ((2 * p, pair.chosen), (2 * p + 1, pair.rejected)):
            tokens_NL[row, P - len(prompt) : P] = prompt
            tokens_NL[row, P : P + len(ids)] = ids
            attn_NL[row, P - len(prompt) : P + len(ids)] = True
    label_N = np.tile([True, False], len(token_pairs))
    return rollouts.Rollouts(
        tokens_NL=tokens_NL,
        attn_mask_NL=attn_NL,
        mask_NM=attn_NL[:, P:].copy(),
        sampler_logp_NM=np.zeros((N, M), np.float32),
        reward_N=label_N.astype(np.float32),
        correct_N=label_N,
        row_weight_N=np.ones((N,), np.float32),
        version_NM=np.zeros((N, M), np.int32),
        prompt_len=P,
    )


def sample_pairs(source, params, ids, rng, version, mode):
    """Pairs formed from samples of training prompts `ids`: `source` (a `RolloutSource`)
    generates them with `params` (policy `version`) and scores them with the run's verifier;
    each prompt's samples give its pairs (`pairs_from_samples` in `mode`, on their texts).

    Returns (pairs, token_pairs, stats): the pairs as text (`Pair`, `source` naming the
    training problem and the samples) and as the sampled tokens themselves (`TokenPair`: the
    prompt as it was sampled, each completion's tokens up to and with its stop token), and
    `prompts`, `pairs`, `prompts_without_pair` with what the step record and the compute
    counters read of the samples (`reward`, `correct`, `lengths`, `truncated`,
    `interrupted`, `prompt_ids`, `failures`; `prompt_tokens`, `prompt_len`).
    """
    s = source.sample(params, ids, rng, version)
    G = len(s.texts) // len(ids)
    pairs, token_pairs, without = [], [], 0
    for b, i in enumerate(ids):
        texts = s.texts[b * G : (b + 1) * G]
        got = preferences.pairs_from_samples(
            [source.problems[i].prompt], [texts], [s.reward_N[b * G : (b + 1) * G]], mode
        )
        without += not got
        prompt = tuple(int(t) for t, m in zip(s.prompt_BP[b], s.prompt_mask_BP[b]) if m)
        for p in got:  # Samples of one text score alike: the first of each text stands for it.
            chosen, rejected = (b * G + texts.index(x) for x in (p.chosen, p.rejected))
            token_pairs.append(TokenPair(prompt, _completion(s, chosen), _completion(s, rejected)))
            # "prompt 0: sample i over j" -> "train problem ID: sample i over j".
            pairs.append(
                dataclasses.replace(p, source=p.source.replace("prompt 0", f"train problem {i}", 1))
            )
    stats = {
        "prompts": len(ids),
        "pairs": len(pairs),
        "prompts_without_pair": without,
        "reward": s.reward_N,
        "correct": s.reward_N > 0,
        "lengths": s.lengths_N,
        "truncated": s.truncated_N,
        "interrupted": s.interrupted_N,
        "prompt_ids": list(ids),
        "failures": s.failures,
        "prompt_tokens": s.prompt_tokens,
        "prompt_len": s.prompt_BP.shape[1],
    }
    return pairs, token_pairs, stats


def _completion(samples, row: int) -> tuple[int, ...]:
    return tuple(int(t) for t in samples.tokens_NM[row, : samples.lengths_N[row]])


@dataclasses.dataclass
class PairSet:
    """The pairs a preference run's batches come from, and where their draw stands.

    Attributes:
      pairs: the pairs in force: the file's (set again after a restore, `attach`) or the
        current round's.
      stream: reshuffled epochs over their indices.
      round: the current round (iterative; -1 before the first, and for a file).
      stats: `pairs`, and where they were sampled `prompts` and `prompts_without_pair`.
      digest: the pairs' fingerprint (`digest`).
      saved: whether the pairs are saved with the state (a round's) or re-read (a file's).
    """

    pairs: list | None = None
    stream: filters.PromptStream | None = None
    round: int = -1
    stats: dict = dataclasses.field(default_factory=dict)
    digest: str = ""
    saved: bool = False

    def use(self, pairs, *, seed: int, stats: dict, round: int = -1, saved: bool = False):
        """Puts `pairs` in force, their draw from the start (shuffled by `seed`)."""
        self.pairs, self.round, self.stats, self.saved = list(pairs), round, dict(stats), saved
        self.stream = filters.PromptStream(len(self.pairs), seed=seed)
        self.digest = digest(self.pairs)

    def attach(self, pairs, key: str) -> None:
        """The pairs of a restored draw whose pairs are not saved (a file's): the same pairs
        the checkpoint was trained on, or an error naming `key`."""
        if digest(pairs) != self.digest:
            raise ValueError(
                f"{key}: the pairs differ from those the checkpoint was trained on "
                f"({len(pairs)} pairs, digest {digest(pairs)}; the checkpoint's: "
                f"{self.stream.num_prompts} pairs, digest {self.digest}): restore the file, "
                "or start a new workdir"
            )
        self.pairs = list(pairs)

    def draw(self, n: int) -> list[int]:
        """The next `n` pair indices (none when there are no pairs)."""
        return self.stream.next(n) if self.pairs else []

    def epochs(self) -> float:
        """Epochs over the pairs drawn so far."""
        s = self.stream
        return s.epoch + s.position / max(s.num_prompts, 1)

    def state(self) -> dict:
        return {
            "pairs": [[list(x) for x in p] for p in self.pairs] if self.saved else None,
            "stream": None if self.stream is None else self.stream.state(),
            "round": self.round,
            "stats": self.stats,
            "digest": self.digest,
            "saved": self.saved,
        }

    @classmethod
    def from_state(cls, d: dict) -> "PairSet":
        pairs = d["pairs"]
        return cls(
            pairs=None if pairs is None else [TokenPair(*map(tuple, p)) for p in pairs],
            stream=None if d["stream"] is None else filters.PromptStream.from_state(d["stream"]),
            round=d["round"],
            stats=d["stats"],
            digest=d["digest"],
            saved=d["saved"],
        )


def round_seed(seed: int, round_index: int) -> int:
    """The shuffle seed of a round's pairs (-1: a file's)."""
    return int(np.random.SeedSequence([seed, round_index + 1]).generate_state(1)[0])


def made_settings(
    *,
    seed: int,
    task,
    tokenizer,
    model_name: str,
    model,
    sft,
    init,
    sampling,
    batch,
    reward,
    preference,
) -> dict:
    """What pairs sampled from the warm start depend on: the settings of their stage, from the
    run's sections as configured (`model` before the tokenizer sets its vocabulary,
    `batch.prompt_pool` before set-up fills it: 0 for every training problem)."""
    pref = dataclasses.asdict(preference)
    return {
        "seed": seed,
        "task": task.to_dict(),
        "tokenizer": dataclasses.asdict(tokenizer),
        "model": warm_start.model_settings(model_name, model),
        **{k: dataclasses.asdict(v) for k, v in (("sft", sft), ("init", init))},
        "sampling": dataclasses.asdict(sampling),
        "prompt_pool": batch.prompt_pool,
        # The samples pairs are formed from: `preference.samples` in a preference run,
        # `batch.group_size` where the RL generator samples them (a reward model's pairs).
        "samples_per_prompt": batch.samples_per_prompt,
        "reward.fn": reward.fn,
        "preference": {k: v for k, v in pref.items() if k not in ("iterations_every", "samples")},
    }


def read_made(workdir: str, settings: dict) -> tuple[list[Pair], dict] | None:
    """The pairs sampled from the warm start and cached in `workdir`, with their record, or
    None when the stage is not complete (`stage_cache.lookup`, which refuses pairs made with
    other `settings` than these, `made_settings`)."""
    stage = stage_cache.PREFERENCE_PAIRS
    record = stage_cache.lookup(workdir, stage, settings)
    if record is None:
        return None
    return preferences.read_pairs(
        os.path.join(stage_cache.path(workdir, stage), PAIRS_FILE)
    ), record


def write_made(workdir: str, settings: dict, pairs, record: dict) -> None:
    """Caches pairs sampled from the warm start (with `settings`, `made_settings`): the
    pairs, then the stage's marker."""
    stage = stage_cache.PREFERENCE_PAIRS
    path = stage_cache.begin(workdir, stage)
    preferences.write_pairs(os.path.join(path, PAIRS_FILE), pairs)
    stage_cache.complete(workdir, stage, settings, record)


class PairSource:
    """A preference run's batches: the pairs put in force (a file's, ones made from the warm
    start, or each round's) and drawn into learner rows.

    Args:
      preference: the run's `preference` section (`rl.dpo.PreferenceConfig`).
      batch: its `batch` section (`rollouts.BatchConfig`), `prompt_pool` filled at set-up.
      seed: the run's seed.
      setup: its parts (`setup.Setup`: the file's pairs, tokenizer, generator, learner, and
        the settings of the stage that caches pairs made from the warm start).
      source: its `RolloutSource`, which samples and scores the completions pairs are formed
        from, drawing a round's prompts from the run's prompt stream.
      workdir: where pairs made from the warm start are cached.
    """

    def __init__(self, preference, batch, seed: int, setup, source, workdir: str):
        self.preference, self.batch_cfg, self.seed = preference, batch, seed
        self.s, self.source, self.workdir = setup, source, workdir
        self.settings = setup.stage_settings[stage_cache.PREFERENCE_PAIRS]

    def start(self, run, comp, fresh: bool) -> None:
        """Puts a file's pairs in force (`preference.file`; sampled from the warm start and
        cached first when it is `SAMPLE_AT_SETUP`): from the start of their draw in a fresh run
        (pairs made by the run add their sampling to the compute counters), or checked
        against the checkpoint's in a resumed one. Nothing for iterative rounds."""
        path = self.preference.file
        if not path:
            return
        token_pairs, cost = self.s.preference_pairs, None
        stats = {"pairs": len(token_pairs)}
        if path == SAMPLE_AT_SETUP:
            made = read_made(self.workdir, self.settings)
            # Every process samples (the generator spans them), so all make the pairs unless
            # every one has them.
            if int(sharding.sum_over_processes(np.int32(made is None))):
                if not fresh:
                    raise ValueError(
                        f"preference.file={SAMPLE_AT_SETUP!r}: the pairs this run trained on "
                        f"({stage_cache.path(self.workdir, stage_cache.PREFERENCE_PAIRS)}) are "
                        "missing; start a new workdir"
                    )
                made = self.make(run)
            pairs, cost = made
            token_pairs, _ = encode_pairs(pairs, self.s.tokenizer, self.s.scfg)  # Sampled: fit.
            stats = {k: cost[k] for k in ("prompts", "pairs", "prompts_without_pair")}
        if not fresh:
            run.pairs.attach(token_pairs, f"preference.file={path!r}")
            return
        run.pairs.use(token_pairs, seed=round_seed(self.seed, -1), stats=stats)
        if cost is not None:  # The pairs' sampling, counted as a round's is.
            comp.add_sampling(self.s.model_cfg, cost["sampled_tokens"], cost["prompt_len"])
            comp.add_seconds(cost["seconds"], cost["devices"])

    def make(self, run) -> tuple[list[Pair], dict]:
        """Pairs from the warm start's samples of the first `preference.prompts` training
        prompts of the pool (0: all), cached in the workdir; and their record."""
        p, s = self.preference, self.s
        t = time.time()
        ids = list(range(p.prompts or self.batch_cfg.prompt_pool))
        params, _ = s.generator_params(run.train.params)
        pairs, _, stats = sample_pairs(
            self.source, params, ids, jax.random.fold_in(run.rng, 0), 0, p.pairs
        )
        record = {
            **{k: stats[k] for k in ("prompts", "pairs", "prompts_without_pair")},
            "sampled_tokens": stats["prompt_tokens"] + float(stats["lengths"].sum()),
            "prompt_len": stats["prompt_len"],
            "pass_rate": float(stats["correct"].mean()),
            "seconds": time.time() - t,
            "devices": s.mesh.devices.size,
        }
        if not pairs:
            raise ValueError(
                f"preference.file={SAMPLE_AT_SETUP!r}: the warm start's {len(ids)} x "
                f"{self.batch_cfg.samples_per_prompt} samples (prompts x samples per prompt) "
                f"formed no pair (pass rate {record['pass_rate']:.3f}): every prompt's samples "
                "scored alike; sample more"
            )
        if jax.process_index() == 0:
            write_made(self.workdir, self.settings, pairs, record)
        return pairs, record

    def new_round(self, run, comp, step: int) -> dict:
        """A round of iterative DPO before `step`: `preference.samples` completions of each of
        the round's prompts (`preference.prompts`, 0: iterations_every x batch.prompts, drawn
        from the run's prompt stream) sampled with the current policy and scored, pairs
        formed and put in force, their sampling counted as the online loop counts it, and the
        reference set to the current policy. Returns the round's stats (`sample_pairs`)."""
        p, s, source = self.preference, self.s, self.source
        params, _ = s.generator_params(run.train.params)
        version = int(sharding.fetch(run.train.step))
        ids = source.stream.next(p.prompts or p.iterations_every * self.batch_cfg.prompts)
        rng = jax.random.fold_in(run.rng, step)
        _, token_pairs, stats = sample_pairs(source, params, ids, rng, version, p.pairs)
        comp.add_sampling(
            s.model_cfg, stats["prompt_tokens"] + float(stats["lengths"].sum()), stats["prompt_len"]
        )
        r = run.pairs.round + 1
        kept = {k: stats[k] for k in ("prompts", "pairs", "prompts_without_pair")}
        run.pairs.use(token_pairs, seed=round_seed(self.seed, r), stats=kept, round=r, saved=True)
        if run.ref is not None:  # The reference of this round: the policy at its start.
            run.ref = s.learner.reference(run.train.params)
        return stats

    def batch(self, pair_set) -> tuple[rollouts.Rollouts | None, list[int]]:
        """The next `batch.prompts` pairs' rows and their indices (None, [] when there are no
        pairs: a round whose samples all scored alike)."""
        ids = pair_set.draw(self.batch_cfg.prompts)
        if not ids:
            return None, []
        return pair_rollouts([pair_set.pairs[i] for i in ids], self.s.scfg), ids

    def reference(self, run):
        """The reference params the losses read: the current round's (iterative), else the
        warm start's (None for a reference-free loss)."""
        return run.ref if run.ref is not None else self.s.ref_params
