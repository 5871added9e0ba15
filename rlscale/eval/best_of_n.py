"""Test-time scaling: accuracy against N (pass@N, best-of-N and weighted voting per scorer), the
scorers (`Ranker`s: logprob, reward model, PRM), and the curves' table and plot. See
docs/evaluation.md.

Dimension letters: B problems, G samples per problem, N = B * G rows.
"""

import os
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np

from rlscale.eval import estimators
from rlscale.eval import step_search as step_search_lib
from rlscale.reward_models import prm as prm_lib
from rlscale.reward_models import scalar_head
from rlscale.sampling import scoring


class Ranker(NamedTuple):
    """One scorer of `--scorer` (not the task's verifier, `sampling.scoring.Scorer`).

    Attributes:
      name: the curves' suffix: `best_of/<name>`, `wmaj@N/<name>`.
      score: `(samples, problems) -> [N]` float scores of the rows of `samples` (prompt-major,
        `problems[b]` the problem of prompt b); higher is better, NaN ranks last.
      vote_weight: `[...] scores -> [...]` finite vote weights >= 0 (NaN scores: 0).
    """

    name: str
    score: Callable[[scoring.Samples, Sequence], np.ndarray]
    vote_weight: Callable[[np.ndarray], np.ndarray]


def mean_logprob(samples: scoring.Samples) -> np.ndarray:
    """[N] mean logprob of each completion's sampled tokens (0 for an empty completion)."""
    mask = samples.mask_NM
    return (samples.logprobs_NM * mask).sum(1) / np.maximum(mask.sum(1), 1)


def logprob_ranker() -> Ranker:
    """The policy's own likelihood: mean token logprob; votes weighted exp(mean logprob)."""
    return Ranker(
        "logprob",
        lambda samples, problems: mean_logprob(samples).astype(np.float64),
        lambda s: np.nan_to_num(np.exp(s), nan=0.0),
    )


def _sigmoid(x):
    """`prm_lib.sigmoid`, with NaN -> 0 (no vote)."""
    return np.nan_to_num(prm_lib.sigmoid(x), nan=0.0)


def sample_ids(samples: scoring.Samples) -> tuple[list[list[int]], list[list[int]]]:
    """Each row's prompt ids (its BOS included, padding dropped) and completion ids (with the
    EOS when sampling stopped there), as the RL loop holds them."""
    N, B = samples.tokens_NM.shape[0], samples.prompt_BP.shape[0]
    G = N // B
    prompts = [row[m].tolist() for row, m in zip(samples.prompt_BP, samples.prompt_mask_BP)]
    completions = [samples.tokens_NM[i, : samples.lengths_N[i]].tolist() for i in range(N)]
    return [prompts[i // G] for i in range(N)], completions


def reward_model_ranker(rm) -> Ranker:
    """A loaded `reward_model.RewardModel`: r(x, y); votes weighted sigmoid(r).

    Rows are scored in one bucket of `rm.config.seq_len` tokens, or of the longest row when a
    row is longer (the score does not depend on the bucket); the caller checks the longest
    possible row against the decoder's `max_seq_len` before sampling."""

    def score(samples, problems):
        prompt_ids, completion_ids = sample_ids(samples)
        longest = max(len(p) + len(c) + 1 for p, c in zip(prompt_ids, completion_ids))
        model = rm.with_bucket(longest)
        return model.score_completions(prompt_ids, completion_ids).astype(np.float64)

    return Ranker("reward_model", score, _sigmoid)


def prm_ranker(prm, aggregation: str) -> Ranker:
    """A loaded `prm.ProcessRewardModel`: the `aggregation` ("min", "last",
    "product") of its step probabilities (`prm_lib.prm_scores`); votes weighted by that
    probability."""

    def score(samples, problems):
        prompt_ids, completion_ids = sample_ids(samples)
        longest = max(len(p) + len(c) for p, c in zip(prompt_ids, completion_ids))
        model = prm.with_bucket(longest)
        return prm_lib.prm_scores(model, prompt_ids, completion_ids, aggregation)

    return Ranker(f"prm_{aggregation}", score, lambda p: np.nan_to_num(p, nan=0.0))


# ------------------------------------------------------------------------------------------
# Curves, their table and their plot.
# ------------------------------------------------------------------------------------------


def curves(
    rewards_BG,
    ns: Sequence[int],
    scores: dict | None = None,
    answers_BG: Sequence[Sequence[str | None]] | None = None,
    weights: dict | None = None,
    *,
    seed: int = 0,
    max_subsets: int = estimators.MAX_SUBSETS,
) -> dict:
    """The test-time scaling curves (module docstring), each a list over `ns`.

    A sample is correct (pass@N) when its reward is positive; best-of-N and voting average
    the rewards themselves.

    Args:
      rewards_BG: [B, G] rewards.
      ns: the N values, each in [1, G].
      scores: {scorer: [B, G] scores}: a `best_of/<scorer>` curve each.
      answers_BG: [B][G] extracted answers: the `maj@N` curve (none without answers).
      weights: {scorer: [B, G] vote weights}: a `wmaj@N/<scorer>` curve each (with answers).
      seed: the random subsets' seed where voting cannot count them all.
      max_subsets: `estimators.maj_at_n`'s.

    Returns:
      {"N": ns, "pass@N": [...], "best_of/<scorer>": [...], "maj@N": [...],
      "wmaj@N/<scorer>": [...], "stderr": {voting curve: [Monte-Carlo standard error of the
      mean over problems, 0 where exact]}, "vote_subsets": [subsets counted per problem at
      each N (C(G, N) where exact)]}; the voting keys only with answers.
    """
    rewards_BG = np.asarray(rewards_BG, np.float64)
    B, G = rewards_BG.shape
    correct_B = (rewards_BG > 0).sum(1)
    out = {"N": [int(n) for n in ns]}
    out["pass@N"] = [float(estimators.pass_at_k(G, correct_B, n).mean()) for n in ns]
    for name, s_BG in (scores or {}).items():
        out[f"best_of/{name}"] = [
            float(estimators.best_of_n(s_BG, rewards_BG, n).mean()) for n in ns
        ]
    if answers_BG is None:
        return out
    stderr, subsets = {}, []
    # Every weighting votes over the same subsets (the same seed): their differences are the
    # weights', not the draws'.
    voters = {"maj@N": None} | {f"wmaj@N/{k}": w for k, w in (weights or {}).items()}
    for key, w_BG in voters.items():
        votes = [
            estimators.maj_at_n(answers_BG, rewards_BG, n, w_BG, max_subsets=max_subsets, seed=seed)
            for n in ns
        ]
        out[key] = [float(v.value_B.mean()) for v in votes]
        stderr[key] = [float(np.sqrt((v.stderr_B**2).sum()) / B) for v in votes]
        subsets = [v.subsets for v in votes]
    out["stderr"] = stderr
    out["vote_subsets"] = subsets
    return out


def curve_keys(c: dict) -> list[str]:
    """The curves of a `curves` dict, in its order."""
    return [k for k in c if k not in ("N", "stderr", "vote_subsets")]


def table(c: dict) -> str:
    """The curves as a text table, one row per curve, one column per N; a voting value
    estimated from random subsets is followed by `~` (its standard error is in `stderr`)."""
    width = max(len(k) for k in curve_keys(c)) + 2
    lines = [f"  {'N':<{width}}" + "".join(f"{n:>9}" for n in c["N"])]
    for key in curve_keys(c):
        err = c.get("stderr", {}).get(key, [0.0] * len(c["N"]))
        cells = [f"{v:>8.4f}" + ("~" if e > 0 else " ") for v, e in zip(c[key], err)]
        lines.append(f"  {key:<{width}}" + "".join(cells))
    if any(e > 0 for errs in c.get("stderr", {}).values() for e in errs):
        most = max(e for errs in c["stderr"].values() for e in errs)
        lines.append(
            f"  ~: a mean over {max(c['vote_subsets'])} random subsets per problem "
            f"(standard error <= {most:.1e})"
        )
    return "\n".join(lines)


def plot(c: dict, path: str, *, title: str | None = None) -> str:
    """Draws the curves against N (log2 axis) and saves a PNG (matplotlib's Agg canvas, no
    pyplot state): pass@N black dashed, maj@N grey dotted, and one colour per scorer, its
    best-of-N solid and its weighted vote dotted; votes estimated from random subsets carry
    their Monte-Carlo error bars. Returns `path`."""
    import matplotlib.ticker
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.5), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    ns = c["N"]
    scorers = list(dict.fromkeys(key.split("/", 1)[1] for key in curve_keys(c) if "/" in key))
    colors = {"pass@N": "black", "maj@N": "grey"}
    for key in curve_keys(c):
        scorer = key.split("/", 1)[1] if "/" in key else None
        color = colors.get(key) or f"C{scorers.index(scorer) % 10}"
        fmt = "o--" if key == "pass@N" else "s:" if "maj@N" in key else "o-"
        yerr = c.get("stderr", {}).get(key)
        ax.errorbar(ns, c[key], yerr=yerr, fmt=fmt, color=color, ms=4, label=key)
    ax.set_xscale("log", base=2)
    ax.set_xticks(ns)
    ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xlabel("N (samples per problem)")
    ax.set_ylabel("accuracy (mean reward)")
    ax.set_title(title or "test-time scaling")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    return path


# ==========================================================================================
# The flags: the N values, the scorers.
# ==========================================================================================

# `--scorer`'s choices (`Ranker`s); `prm` is one ranker per `--prm_aggregation`.
SCORERS = ("logprob", "reward_model", "prm")


def _best_of_problems(values: Sequence, k: int) -> tuple[list[int], list[str]]:
    """The N values of `--best_of` (ints, or strings as the flag gives them), increasing, and
    what is wrong with them: no value, a non-integer, N < 1, N > k, a duplicate."""
    problems, ns = [], []
    for v in values:
        try:
            n = int(str(v).strip())
        except ValueError:
            problems.append(f"{str(v)!r} is not an integer")
            continue
        if not 1 <= n <= k:
            problems.append(f"N={n} is outside [1, --k={k}]")
        ns.append(n)
    twice = sorted({n for n in ns if ns.count(n) > 1})
    if twice:
        problems.append(f"N={', '.join(map(str, twice))} given more than once")
    if not values:
        problems.append("no N given")
    return sorted(ns), problems


def check_test_time_flags(
    best_of: Sequence | None,
    k: int,
    scorers: Sequence[str],
    reward_model_dir: str | None,
    plot: str | None,
    prm_dir: str | None = None,
    prm_aggregation: Sequence[str] = ("min",),
    step_search=None,
    step_search_aggregation: str = step_search_lib.DEFAULT_AGGREGATION,
) -> list[int] | None:
    """The N values of `--best_of` (None without it), increasing.

    Raises:
      ValueError: Naming the flags, every problem at once: a bad `--best_of` (no value, a
        non-integer, N < 1, N > k, a duplicate), an unknown or repeated `--scorer`, a
        `reward_model` scorer without `--reward_model` or the reverse (`prm` and `--prm`
        alike), an unknown `--prm_aggregation`, or `--scorer`, `--reward_model`, `--prm` or
        `--plot` without `--best_of`; a malformed `--step_search` (`step_search.parse_beam`),
        one without `--prm`, or an unknown `--step_search_aggregation`. `--prm` with
        `--step_search` needs neither `--scorer=prm` nor `--best_of`.
    """
    problems, ns = [], None
    if best_of is not None:
        ns, wrong = _best_of_problems(best_of, k)
        if wrong:
            problems.append(f"--best_of={','.join(map(str, best_of))}: " + "; ".join(wrong))
    names = list(scorers)
    for name in dict.fromkeys(names):
        if name not in SCORERS:
            problems.append(f"--scorer: {name!r} is not one of {', '.join(SCORERS)}")
        if names.count(name) > 1:
            problems.append(f"--scorer: {name!r} given more than once")
    if "reward_model" in names and not reward_model_dir:
        problems.append("--scorer=reward_model needs --reward_model DIR")
    if reward_model_dir and "reward_model" not in names:
        problems.append(
            f"--reward_model={reward_model_dir} is unused: --scorer does not name reward_model"
        )
    if "prm" in names and not prm_dir:
        problems.append("--scorer=prm needs --prm DIR")
    if prm_dir and "prm" not in names and step_search is None:
        problems.append(f"--prm={prm_dir} is unused: --scorer does not name prm")
    if step_search is not None:
        try:
            step_search_lib.parse_beam(step_search)
        except ValueError as e:
            problems.append(str(e))
        if not prm_dir:
            raw = step_search if isinstance(step_search, str) else ",".join(map(str, step_search))
            problems.append(
                f"--step_search={raw} needs --prm DIR: the process reward model that scores "
                "each step"
            )
        if step_search_aggregation not in prm_lib.AGGREGATIONS:
            problems.append(
                f"--step_search_aggregation={step_search_aggregation!r} is not one of "
                f"{', '.join(prm_lib.AGGREGATIONS)}"
            )
    bad = [a for a in prm_aggregation if a not in prm_lib.AGGREGATIONS]
    if bad:
        problems.append(
            f"--prm_aggregation: {', '.join(map(repr, bad))} not one of "
            f"{', '.join(prm_lib.AGGREGATIONS)}"
        )
    if best_of is None and (
        names != ["logprob"] or reward_model_dir or (prm_dir and step_search is None)
    ):
        problems.append(
            "--scorer, --reward_model and --prm score the --best_of curves: pass --best_of"
        )
    if best_of is None and plot:
        problems.append(f"--plot={plot}: plots the --best_of curves: pass --best_of")
    if problems:
        raise ValueError("; ".join(problems))
    return ns


def load_scoring_model(flag: str, path: str, load, tokenizer, longest: int):
    """`load(path)` (`bradley_terry.load` or `prm_lib.load`), checked against the
    policy's tokenizer and the longest row it will score (`longest` tokens: the longest
    prompt, max_new_tokens and the EOS); errors name `--{flag}`."""
    if not os.path.isdir(path):
        raise ValueError(f"--{flag}={path}: no such directory")
    try:
        model = load(path)
        scalar_head.check_tokenizer(path, tokenizer)
    except (FileNotFoundError, ValueError) as e:
        raise ValueError(f"--{flag}={path}: {e}") from e
    if longest > model.model_cfg.max_seq_len:
        raise ValueError(
            f"--{flag}={path}: its decoder reads at most max_seq_len="
            f"{model.model_cfg.max_seq_len} tokens, but the longest prompt with "
            f"--config.sampling.max_new_tokens and the EOS makes {longest}"
        )
    return model


def rankers(
    names: Sequence[str], reward_model=None, prm=None, prm_aggregation: Sequence[str] = ("min",)
) -> list[Ranker]:
    """The `--scorer`s as `Ranker`s, in order (`reward_model`, `prm`: loaded ones;
    `prm` gives one ranker per aggregation)."""
    out = []
    for name in names:
        if name == "logprob":
            out.append(logprob_ranker())
        elif name == "reward_model":
            out.append(reward_model_ranker(reward_model))
        else:
            out += [prm_ranker(prm, how) for how in prm_aggregation]
    return out
