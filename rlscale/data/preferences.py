"""Preference pairs (prompt, chosen, rejected): read from files, or formed from scored samples
(`best_vs_worst`, `all`). See docs/preference_and_reward_models.md.
"""

import dataclasses
import json
import math
import os
from collections.abc import Sequence

from absl import logging

from rlscale.data import formats

MODES = ("best_vs_worst", "all")
_TIES_LISTED = 5  # Lines of dropped ties named in the warning.


@dataclasses.dataclass(frozen=True)
class Pair:
    """A prompt with a preferred (`chosen`) and a dispreferred (`rejected`) completion.

    `source` says where the pair came from (`train.jsonl:12`, `prompt 3: sample 0 over 2`),
    for messages; it takes no part in equality.
    """

    prompt: str
    chosen: str
    rejected: str
    source: str = dataclasses.field(default="", compare=False)


def read_pairs(
    path: str,
    *,
    prompt_field: str = "prompt",
    chosen_field: str = "chosen",
    rejected_field: str = "rejected",
) -> list[Pair]:
    """Reads the preference pairs of a file, in file order (see the module docstring).

    Args:
      path: A `.jsonl`, `.json` or `.parquet` file, or a `datasets` directory.
      prompt_field, chosen_field, rejected_field: the columns holding each side.

    Returns:
      The pairs, ties (chosen == rejected) dropped.

    Raises:
      FileNotFoundError: If `path` does not exist.
      ValueError: On malformed rows (each named by file and line), an empty file, a file
        whose pairs are all ties, or field names that are empty or not distinct.
    """
    names = {"prompt_field": prompt_field, "chosen_field": chosen_field}
    names["rejected_field"] = rejected_field
    bad = [f"{k}={v!r} is empty" for k, v in names.items() if not v]
    if len(set(names.values())) < 3:
        bad.append(f"the field names must differ, got {sorted(names.values())}")
    if bad:
        raise ValueError("read_pairs: " + "; ".join(bad))
    if not os.path.exists(path):
        raise FileNotFoundError(f"preference file not found: {path!r}")
    problem = formats.check_path(path)
    if problem:
        raise ValueError(f"{path}: {problem}")
    fields = (prompt_field, chosen_field, rejected_field)
    pairs, errors, ties, rows = [], [], [], 0
    for where, source, record in formats.records(path):
        rows += 1
        if isinstance(record, ValueError):
            errors.append(f"{path}, {where}: {record}")
            continue
        if not isinstance(record, dict):
            errors.append(
                f"{path}, {where}: a row must be a JSON object, got {formats.kind(record)}"
            )
            continue
        missing = [f for f in fields if f not in record]
        mistyped = [f for f in fields if f in record and not isinstance(record[f], str)]
        if missing or mistyped:
            what = [f"has no {f!r}" for f in missing]
            what += [f"{f!r} must be a string, got {formats.kind(record[f])}" for f in mistyped]
            errors.append(f"{path}, {where}: {'; '.join(what)}")
            continue
        pair = Pair(*(record[f] for f in fields), source=source)
        if pair.chosen == pair.rejected:
            ties.append(where)
        else:
            pairs.append(pair)
    if errors:
        raise ValueError(formats.malformed_rows(path, errors))
    if not rows:
        raise ValueError(f"{path}: no rows (an empty file)")
    if ties:
        first = ", ".join(ties[:_TIES_LISTED]) + (", ..." if len(ties) > _TIES_LISTED else "")
        logging.warning(
            "%s: dropped %d of %d pairs whose chosen equals rejected (%s)",
            path,
            len(ties),
            rows,
            first,
        )
    if not pairs:
        raise ValueError(f"{path}: all {rows} pairs have chosen == rejected: no preference left")
    return pairs


def pairs_from_samples(
    prompts: Sequence[str],
    completions: Sequence[Sequence[str]],
    rewards: Sequence[Sequence[float]],
    mode: str = "best_vs_worst",
) -> list[Pair]:
    """Preference pairs from scored samples (modes in the module docstring).

    Args:
      prompts: B prompts.
      completions: for each prompt, its sampled completions (G of them; G may vary).
      rewards: for each prompt, its completions' rewards (an array [B, G] works).
      mode: one of `MODES`.

    Returns:
      The pairs, prompt-major; each `source` names the prompt and the two samples.

    Raises:
      ValueError: On an unknown mode, lengths that do not match (naming the prompt), or a
        reward that is not a finite number (naming the prompt and the sample).
    """
    if mode not in MODES:
        raise ValueError(f"pairs_from_samples: mode={mode!r} is not one of {MODES}")
    if not len(prompts) == len(completions) == len(rewards):
        raise ValueError(
            f"pairs_from_samples: {len(prompts)} prompts, {len(completions)} completion lists "
            f"and {len(rewards)} reward lists; they must match"
        )
    problems = []
    for b, (texts, scores) in enumerate(zip(completions, rewards)):
        if len(texts) != len(scores):
            problems.append(f"prompt {b}: {len(texts)} completions but {len(scores)} rewards")
        for g, r in enumerate(scores):
            if not _finite(r):
                problems.append(f"prompt {b}, sample {g}: reward {r!r} is not a finite number")
    if problems:
        raise ValueError("pairs_from_samples: " + "; ".join(problems))
    pairs = []
    for b, (prompt, texts, scores) in enumerate(zip(prompts, completions, rewards)):
        scores = [float(r) for r in scores]
        if mode == "best_vs_worst":
            if not scores:
                continue
            # max/min over indices return the first of equal rewards: deterministic.
            best = max(range(len(scores)), key=scores.__getitem__)
            worst = min(range(len(scores)), key=scores.__getitem__)
            candidates = [(best, worst)] if scores[best] > scores[worst] else []
        else:
            n = range(len(scores))
            candidates = [(i, j) for i in n for j in n if scores[i] > scores[j]]
        pairs += [
            Pair(prompt, texts[i], texts[j], source=f"prompt {b}: sample {i} over {j}")
            for i, j in candidates
            if texts[i] != texts[j]
        ]
    return pairs


def _finite(r) -> bool:
    if isinstance(r, str | bytes):  # float("1") would parse: a string reward is a bug.
        return False
    try:
        return math.isfinite(float(r))
    except (TypeError, ValueError):
        return False


def write_pairs(path: str, pairs: Sequence[Pair]) -> None:
    """Writes pairs as jsonl rows `{"prompt", "chosen", "rejected"}`, the layout `read_pairs`
    reads back (the same pairs, in order; `source` is not written)."""
    with open(path, "w", encoding="utf-8") as f:
        for p in pairs:
            row = {"prompt": p.prompt, "chosen": p.chosen, "rejected": p.rejected}
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
