"""Rollouts: prompts in, scored and filtered completions out (generator requests, scoring, filters,
static shapes, a teacher's logprobs and learned rewards). See docs/learner.md.

Dimension letters: B prompts, G samples per prompt, N = B * G rows, P padded prompt length, M new
tokens, L = P + M.
"""

import concurrent.futures
import copy
import dataclasses

import jax
import numpy as np

from rlscale import sections
from rlscale.data import filters
from rlscale.sampling.generator import Request
from rlscale.sampling.scoring import (
    Samples,
    concat,
    concat_episodes,
    encode_prompts,
    score_completed,
)


@dataclasses.dataclass(frozen=True)
class BatchConfig(sections.Section):
    """`config.batch`: `prompts` prompts a step, `group_size` rows each, drawn from the first
    `prompt_pool` training problems (0: all of them; `with_pool` fills it once the data is
    read). `samples_per_prompt` is derived (`rl.resolve` fills it): the completions the
    generator samples per prompt, `group_size` or, in a preference run that forms its pairs
    from samples, `preference.samples`."""

    prompts: int = 32
    group_size: int = 8
    prompt_pool: int = 0
    samples_per_prompt: int = 0

    def problems(self) -> list[str]:
        problems = []
        if self.prompts < 1:
            problems.append(f"batch.prompts={self.prompts} must be >= 1")
        if self.group_size < 1:
            problems.append(f"batch.group_size={self.group_size} must be >= 1")
        pool = self.prompt_pool
        if not isinstance(pool, int) or not (pool == 0 or pool >= self.prompts):
            problems.append(
                f"batch.prompt_pool={pool!r} must be 0 (every training prompt) or at least "
                f"batch.prompts={self.prompts}"
            )
        return problems

    def with_pool(self, n_train: int) -> "BatchConfig":
        """The section with `prompt_pool` resolved against the task's `n_train` training
        problems (0: all of them)."""
        if self.prompt_pool > n_train:
            raise ValueError(
                f"batch.prompt_pool={self.prompt_pool} is more than the task's {n_train} "
                "training problems"
            )
        return dataclasses.replace(self, prompt_pool=self.prompt_pool or n_train)


@dataclasses.dataclass
class Rollouts:
    """One learner batch, on the host (every process holds all of it). Rows are prompt-major
    groups."""

    tokens_NL: np.ndarray
    attn_mask_NL: np.ndarray
    mask_NM: np.ndarray  # Completion tokens that are trained on.
    sampler_logp_NM: np.ndarray
    reward_N: np.ndarray  # After reward shaping (overlong penalty).
    correct_N: np.ndarray  # The verifier's verdict, before shaping.
    row_weight_N: np.ndarray  # 0 for rows of filtered prompts.
    version_NM: np.ndarray  # Policy version (updates applied) that sampled each token.
    prompt_len: int
    # A distillation teacher's logprob of each completion token (0 past the end); None
    # without a teacher.
    teacher_logp_NM: np.ndarray | None = None
    # A process reward model's step rewards at each step's last token, and where they are
    # (`learned_rewards.StepRewards`); None without one.
    step_reward_NM: np.ndarray | None = None
    step_mask_NM: np.ndarray | None = None
    # An environment's tokens of multi-turn episodes: context, out of `mask_NM` (None: none).
    env_NM: np.ndarray | None = None
    # A mixture of experts' routing as the generator recorded it: the c experts each token of
    # `tokens_NL` went to in each of the l sparse layers (router replay; None: a dense model).
    experts_NLlc: np.ndarray | None = None


def full_length(rows: int, prompt_len: int, max_new_tokens: int, routing_lc=()) -> Rollouts:
    """A batch of `rows` rows whose prompts fill `prompt_len` tokens and whose completions
    are all `max_new_tokens` long and trained on: the largest update a run with these
    settings compiles (its values are zeros; `routing_lc`, a mixture of experts' (l, c):
    with its recorded routing)."""
    N, P, M = rows, prompt_len, max_new_tokens
    experts = np.zeros((N, P + M, *routing_lc), np.uint8) if routing_lc else None
    return Rollouts(
        tokens_NL=np.zeros((N, P + M), np.int32),
        attn_mask_NL=np.ones((N, P + M), bool),
        mask_NM=np.ones((N, M), bool),
        sampler_logp_NM=np.zeros((N, M), np.float32),
        reward_N=np.zeros((N,), np.float32),
        correct_N=np.zeros((N,), bool),
        row_weight_N=np.ones((N,), np.float32),
        version_NM=np.zeros((N, M), np.int32),
        prompt_len=P,
        teacher_logp_NM=np.zeros((N, M), np.float32),
        step_reward_NM=np.zeros((N, M), np.float32),
        step_mask_NM=np.zeros((N, M), bool),
        experts_NLlc=experts,
    )


class RolloutSource:
    """The training prompt stream turned into the learner's batches.

    Each call draws `batch.prompts` prompts (skipping retired ones), samples
    `batch.group_size` completions each and scores them; with DAPO's dynamic sampling it draws
    more rounds until `batch.prompts` groups have mixed correctness (at most
    `filters.dynamic_max_rounds` rounds). Groups whose samples are all correct or all wrong are
    kept with weight 0 (zero-variance filtering) so shapes stay static; the kept groups come
    first. The stream and the pass-rate history are the host state a checkpoint saves.
    """

    def __init__(
        self,
        batch: BatchConfig,
        filter_cfg: filters.FilterConfig,
        decode_chunk: int,
        episodes,
        scfg,
        tokenizer,
        problems,
        scorer,
        stream,
        history,
        teacher=None,
        outcome_model=None,
        step_rewards=None,
    ):
        # The generator engine driven through the run's environments (`envs.episodes`).
        self.episodes, self.scfg, self.tokenizer = episodes, scfg, tokenizer
        self.problems, self.scorer = problems, scorer
        self.stream, self.history = stream, history
        self.teacher = teacher  # A `teacher.Teacher` when the objective reads `teacher_logp`.
        # `learned_rewards.OutcomeReward` (`reward.model`): the reward, in place of the
        # verifier's (which still decides `correct`); `StepRewards` (`reward.prm`).
        self.outcome_model, self.step_rewards = outcome_model, step_rewards
        self.B, self.G = batch.prompts, batch.group_size
        self.filters = filter_cfg
        self.max_new_tokens = scfg.max_new_tokens
        self.decode_chunk = decode_chunk
        self._encoded: dict[int, list[int]] = {}  # Prompt ids, by problem.
        # Scoring runs beside decoding in one process; with several, it stays in order on the
        # main thread (it gathers rewards across processes, as decoding does).
        self._scoring = (
            concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="scoring")
            if jax.process_count() == 1
            else None
        )

    def close(self):
        if self._scoring is not None:
            self._scoring.shutdown()

    def draw(self) -> list[int]:
        """The next `batch.prompts` training prompt ids (retired ones skipped)."""
        return self.stream.next(self.B, self.history.retired)

    def prefetch(self) -> None:
        """Encodes the prompts the next `draw` will return, without drawing them (the stream's
        state is what a checkpoint saves): host work to overlap with the device's."""
        self._encode(copy.deepcopy(self.stream).next(self.B, self.history.retired))

    def _encode(self, ids) -> list[list[int]]:
        new = [i for i in dict.fromkeys(ids) if i not in self._encoded]
        for i, p in zip(new, encode_prompts(self.tokenizer, [self.problems[i] for i in new])):
            self._encoded[i] = p
        return [self._encoded[i] for i in ids]

    def requests(self, ids, rng, tag=None) -> list[Request]:
        """Generator requests for prompts `ids`: request i has id (tag, i) and samples with
        fold_in(rng, i)."""
        prompts = self._encode(ids)
        return [Request((tag, i), p, jax.random.fold_in(rng, i)) for i, p in enumerate(prompts)]

    def submit(self, ids, rng, tag=None) -> None:
        """Queues the requests for prompts `ids` (`requests`), each sample's episode reset
        with its problem."""
        self.episodes.submit(self.requests(ids, rng, tag), [self.problems[i] for i in ids])

    def score(self, episodes, ids) -> Samples:
        """Scored samples of the finished requests (`envs.episodes.Episode`s) for prompts
        `ids` (in request order)."""
        episodes = sorted(episodes, key=lambda e: e.request.id[1])
        problems = [self.problems[ids[e.request.id[1]]] for e in episodes]
        stats = [e.stats for e in episodes]
        return score_completed(
            self.tokenizer,
            self.scorer,
            [e.completed for e in episodes],
            problems,
            self.scfg,
            episodes=None if stats[0] is None else stats,
        )

    def sample(self, params, ids, rng, version) -> Samples:
        """Scored samples of prompts `ids` (`SamplingConfig.num_samples` each, in prompt
        order), generated with `params` (policy `version`), without filters or assembly: what
        a preference run forms its pairs from (`rl.pairs`)."""
        return self._sample(params, ids, rng, version)

    def _sample(self, params, ids, rng, version) -> Samples:
        """Every request for `ids` generated with `params` (policy `version`), and scored:
        requests that complete early are scored while the engine decodes the rest."""
        self.episodes.set_params(params, version)
        self.submit(ids, rng)
        parts, order = [], []
        while len(order) < len(ids):
            completed = self.episodes.step(self.decode_chunk).completed
            if completed:
                order += sorted(c.request.id[1] for c in completed)  # As `score` orders them.
                if self._scoring is None:
                    parts.append(self.score(completed, ids))
                else:
                    parts.append(self._scoring.submit(self.score, completed, ids))
        parts = [p if isinstance(p, Samples) else p.result() for p in parts]
        return concat(parts, self.scfg.pad_id).take(np.argsort(order))

    def judge(self, ids, s: Samples) -> dict:
        """One round: the reward shaping, the pass-rate history and the filters' verdicts."""
        f, G = self.filters, self.G
        correct_N = s.reward_N > 0
        reward_N, scoring_flops = s.reward_N, 0.0
        if self.outcome_model is not None:
            reward_N, scoring_flops = self.outcome_model(s)
        # What the filters judge, before shaping: a shaped reward (the overlong penalty) can
        # give a group of all-correct answers spread that carries no signal about
        # correctness. A reward model's reward is the signal itself.
        signal_N = correct_N if self.outcome_model is None else reward_N
        if f.overlong_cache:  # On the policy's tokens: an environment's replies are not its.
            reward_N = reward_N + filters.overlong_penalty(
                s.policy_lengths_N, self.max_new_tokens, f.overlong_cache
            )
        newly = self.history.update(ids, correct_N.reshape(-1, G)) if f.retire else []
        keep_B = np.ones(len(ids), bool)
        if f.zero_variance or f.dynamic_sampling:
            keep_B = filters.zero_variance_keep(signal_N.reshape(-1, G).astype(np.float32))
        return {
            "ids": list(ids),
            "samples": s,
            "reward": reward_N,
            "correct": correct_N,
            "keep": keep_B,
            "newly": newly,
            "scoring_flops": scoring_flops,
        }

    def next(self, params, rng, version: int) -> tuple[Rollouts, dict]:
        """(Rollouts, stats of every round sampled) for one learner batch, sampled now with
        `params` (policy `version`). Round r's requests use fold_in(rng, r)."""

        def round_(r):
            ids = self.draw()
            return self.judge(ids, self._sample(params, ids, jax.random.fold_in(rng, r), version))

        rounds = [round_(0)]
        if self.filters.dynamic_sampling:  # DAPO: refill filtered groups with fresh ones.
            while (
                sum(int(r["keep"].sum()) for r in rounds) < self.B
                and len(rounds) < self.filters.dynamic_max_rounds
            ):
                rounds.append(round_(len(rounds)))
        return self.rollouts(rounds)

    def rollouts(self, rounds) -> tuple[Rollouts, dict]:
        """The learner batch from judged rounds (with the teacher's logprobs of its tokens
        when the run has a teacher), and their stats."""
        roll, keep_B = self._assemble(rounds)
        # The learned rewards' and the teacher's forward passes: compute the step spends.
        scoring_flops = sum(r["scoring_flops"] for r in rounds)
        if self.teacher is not None:
            roll.teacher_logp_NM = self.teacher(roll)
            scoring_flops += self.teacher.flops(roll, self.max_new_tokens)
        if self.step_rewards is not None:
            roll.step_reward_NM, roll.step_mask_NM, flops = self.step_rewards(roll)
            scoring_flops += flops

        def cat(f):
            return np.concatenate([f(r) for r in rounds])

        episodes = [r["samples"].episodes for r in rounds]
        episodes = None if episodes[0] is None else concat_episodes(episodes)

        stats = {
            "reward": cat(lambda r: r["reward"]),
            "correct": cat(lambda r: r["correct"]),
            # The policy's tokens of each sample; the environments' replies, counted apart
            # (their forward passes cost the sampler as much).
            "lengths": cat(lambda r: r["samples"].policy_lengths_N),
            "env_tokens": sum(
                int(r["samples"].lengths_N.sum() - r["samples"].policy_lengths_N.sum())
                for r in rounds
            ),
            "truncated": cat(lambda r: r["samples"].truncated_N),
            "interrupted": cat(lambda r: r["samples"].interrupted_N),
            "prompt_tokens": sum(r["samples"].prompt_tokens for r in rounds),
            "prompt_ids": [i for r in rounds for i in r["ids"]],
            "kept_prompts": int(keep_B.sum()),
            "filtered_prompts": sum(int((~r["keep"]).sum()) for r in rounds),
            "rounds": len(rounds),
            "scoring_flops": scoring_flops,
            "newly_retired": sum(len(r["newly"]) for r in rounds),
            "failures": {
                k: sum(r["samples"].failures[k] for r in rounds)
                for k in rounds[0]["samples"].failures
            },
            # Per sample, how its episode went (None: single-turn, no `env/` metrics).
            "episodes": episodes,
        }
        return roll, stats

    def _assemble(self, rounds) -> tuple[Rollouts, np.ndarray]:
        """The kept groups first, then (weight 0, for static shapes) dropped ones, `B` groups
        in all; prompts re-padded on the left to the longest round's bucket."""
        G = self.G
        P = max(r["samples"].prompt_BP.shape[1] for r in rounds)

        def learner_rows(r):
            s, keep_N = r["samples"], np.repeat(r["keep"], G)
            env_NM = np.zeros_like(s.mask_NM) if s.env_NM is None else s.env_NM
            pad = ((0, 0), (P - s.prompt_BP.shape[1], 0))
            prompt_NP = np.pad(np.repeat(s.prompt_BP, G, 0), pad, constant_values=self.scfg.pad_id)
            prompt_mask_NP = np.pad(np.repeat(s.prompt_mask_BP, G, 0), pad)
            routed = {}
            if s.experts_NLlc is not None:  # Re-padded as the prompts.
                routed["experts_NLlc"] = np.pad(s.experts_NLlc, pad + ((0, 0), (0, 0)))
            return {
                **routed,
                "tokens_NL": np.concatenate([prompt_NP, s.tokens_NM], 1).astype(np.int32),
                "attn_mask_NL": np.concatenate([prompt_mask_NP, s.mask_NM], 1),
                # Tokens written by forced interruption or an environment are context, not
                # actions: out of the loss (and of every count of trained tokens).
                "mask_NM": s.mask_NM & ~s.forced_NM & ~env_NM & keep_N[:, None],
                "env_NM": env_NM,
                "sampler_logp_NM": s.logprobs_NM.astype(np.float32),
                "version_NM": s.versions_NM.astype(np.int32),
                "reward_N": r["reward"].astype(np.float32),
                "correct_N": r["correct"],
                "row_weight_N": keep_N.astype(np.float32),
            }

        per_round = [learner_rows(r) for r in rounds]
        picks = [(i, b) for i, r in enumerate(rounds) for b in np.flatnonzero(r["keep"])]
        picks += [(i, b) for i, r in enumerate(rounds) for b in np.flatnonzero(~r["keep"])]
        picks = picks[: self.B]
        fields = {
            k: np.concatenate([per_round[i][k][b * G : (b + 1) * G] for i, b in picks])
            for k in per_round[0]
        }
        roll = Rollouts(**fields, prompt_len=P)
        return roll, np.array([bool(rounds[i]["keep"][b]) for i, b in picks])
