"""The math verifier: `grade(completion, gold)` (fail-closed extraction, math-verify with a numeric
guard), run in worker processes with a deadline; `verify` / `verify_batch` and their failure
counters for standalone use. Rules and decisions: docs/data.md.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import re
import threading
from collections.abc import Callable, Sequence

from rlscale.rewards import sandbox

# An extracted answer longer than this scores 0 unless it is the gold string itself.
MAX_ANSWER_CHARS = 1000
# Seconds one check may take: ordinary answers take milliseconds; adversarial ones (an
# exponent tower, thousands of nested braces) are cut off here and score 0.
DEFAULT_TIMEOUT = 1.5
DEFAULT_MEMORY_LIMIT_BYTES = 4 << 30

# Relative tolerances of the numeric guard (see the module docstring).
_EXACT_RTOL = 1e-30
_INEXACT_RTOL = 5e-3
_GUARD_DIGITS = 50

# -- extraction (runs in the caller's process: plain string scanning, linear time) ---------------

_BOX_RE = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")
_ANSWER_LINE_RE = re.compile(
    r"^[ \t>*#_\-]*(?:final[ \t]+)?answer[ \t]*(?:\*\*|__)?[ \t]*[:：]",
    re.IGNORECASE | re.MULTILINE,
)
_ANSWER_IS_RE = re.compile(
    r"\bthe[ \t]+(?:final[ \t]+)?answer[ \t]+is\b[ \t]*[:：]?", re.IGNORECASE
)
_SENTENCE_END_RE = re.compile(r"\.(?=\s|$)")
_PROSE_WORD_RE = re.compile(r"\s+(?=[A-Za-z]{2,})")
_SCI_RE = re.compile(r"([+-]?(?:\d+(?:\.\d*)?|\.\d+))[eE]([+-]?\d+)")
_UNESCAPED_DOLLAR_RE = re.compile(r"(?<!\\)\$")
_REPLACEMENTS = {
    "\u2212": "-",  # Unicode minus.
    "\u00d7": r"\times ",
    "\u00f7": r"\div ",
    "\u00b7": r"\cdot ",
    "\u00b0": r"^\circ",
    r"\varnothing": r"\emptyset",  # latex2sympy knows only the latter.
}
# `1\,000`: a thin (or other) space between digit groups is a thousands separator.
_SPACED_THOUSANDS_RE = re.compile(r"(?<=\d)\\[,;: ](?=\d{3}(?!\d))")
_MATH_DELIMITERS = (("$$", "$$"), ("\\[", "\\]"), ("\\(", "\\)"), ("$", "$"))


def _final_section(completion: str) -> str | None:
    """Applies the reasoning-format rule: the text after the last `</think>`, or None."""
    if "</think>" in completion:
        return completion.rsplit("</think>", 1)[1]
    if "<think>" in completion:
        return None
    return completion


def braced_argument(text: str, start: int) -> str | None:
    """The content of the `{...}` group opening at `text[start]`, or None if unbalanced."""
    depth = 0
    i = start
    while i < len(text):
        c = text[i]
        if c == "\\":
            i += 2  # `\{` and `\}` are literal braces, `\\` a line break.
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return text[start + 1 : i]
        i += 1
    return None


def _last_boxed(text: str) -> str | None:
    """The argument of the last `\\boxed`/`\\fbox` in `text`, or None if it is malformed."""
    i = list(_BOX_RE.finditer(text))[-1].end()
    while i < len(text) and text[i] in " \t":
        i += 1
    if i >= len(text) or text[i] != "{":
        return None
    return braced_argument(text, i)


def _find_unescaped(text: str, needle: str, start: int) -> int:
    while True:
        i = text.find(needle, start)
        if i <= 0 or text[i - 1] != "\\":
            return i
        start = i + 1


def _answer_span(rest: str) -> str | None:
    """The answer at the start of `rest` (the text after an answer marker)."""
    s = rest.strip()
    s = re.sub(r"^(?:\*\*|__|\*)\s*", "", s)
    for opening, closing in _MATH_DELIMITERS:
        if not s.startswith(opening):
            continue
        end = _find_unescaped(s, closing, len(opening))
        if end >= 0:
            return s[len(opening) : end]
        if opening == "$" and s[1:2].isdigit():
            s = s[1:]  # An unclosed `$` before a digit is a currency sign.
            break
        return None
    s = s.split("\n", 1)[0]
    for pattern in (_SENTENCE_END_RE, _PROSE_WORD_RE):
        m = pattern.search(s)
        if m:
            s = s[: m.start()]
    return s


def _answer_after_marker(text: str) -> str | None:
    """The answer after the last answer marker in `text`, or None."""
    best = None
    for pattern in (_ANSWER_LINE_RE, _ANSWER_IS_RE):
        for m in pattern.finditer(text):
            if best is None or m.start() > best.start():
                best = m
    if best is None:
        return None
    rest = text[best.end() :]
    line, _, following = rest.partition("\n")
    if not line.strip() or line.strip() in ("**", "__"):
        line = next((ln for ln in following.split("\n") if ln.strip()), "")
    return _answer_span(line)


def _clean(answer: str) -> str:
    s = answer.strip()
    for old, new in _REPLACEMENTS.items():
        s = s.replace(old, new)
    s = _SPACED_THOUSANDS_RE.sub("", s)
    s = _UNESCAPED_DOLLAR_RE.sub("", s)
    s = " ".join(s.split())  # Newlines would end math-verify's inline-math match.
    s = re.sub(r"^(?:\*\*|__)+|(?:\*\*|__)+$", "", s).strip()
    s = s.rstrip(" .,;:").strip()  # Not "!": a factorial.
    m = _SCI_RE.fullmatch(s)
    if m:
        s = rf"{m.group(1)}\times 10^{{{m.group(2)}}}"
    return s


def extract_answer(completion: str) -> str | None:
    """Extracts the final answer of a completion, following the rules in the module docstring.

    Args:
        completion: The model's full completion.

    Returns:
        The answer as a LaTeX string without math delimiters, or None when there is none.
    """
    text = _final_section(completion)
    if text is None:
        return None
    if _BOX_RE.search(text):
        answer = _last_boxed(text)
    else:
        answer = _answer_after_marker(text)
    if answer is None:
        return None
    return _clean(answer) or None


def extract_gold(gold: str) -> str:
    """The reference answer of a dataset label.

    A label holding `\\boxed{}` (a MATH solution) gives the last box's argument; a GSM8K
    solution (`... #### 42`) the text after the last `####`; any other label is the answer
    itself.
    """
    if _BOX_RE.search(gold):
        answer = _last_boxed(gold)
        if answer is not None:
            return _clean(answer)
    if "####" in gold:
        return _clean(gold.rsplit("####", 1)[1])
    return _clean(gold)


def _to_check(completion: str, gold: str) -> tuple[tuple[str, str] | None, str | None]:
    """((prediction, gold answer), None) when there is something to check, else (None, the
    counter that says why not: "invalid_gold", "no_answer" or "too_long")."""
    pred_answer = extract_answer(completion)
    gold_answer = extract_gold(gold)
    if not gold_answer:
        return None, "invalid_gold"
    if pred_answer is None:
        return None, "no_answer"
    if len(pred_answer) > MAX_ANSWER_CHARS and pred_answer.strip() != gold_answer.strip():
        return None, "too_long"  # No real answer is this long: do not spend a parse on it.
    return (pred_answer, gold_answer), None


# -- checking (runs in worker processes) --------------------------------------------------------

_guard_lock = threading.Lock()


def _values_agree(a, b) -> bool:
    """Whether two values that math-verify found numerically equal really are (the guard)."""
    import sympy

    if not (isinstance(a, sympy.Expr) and isinstance(b, sympy.Expr)):
        return True  # Matrices compare element by element through the guarded function.
    if a.free_symbols or b.free_symbols:
        return True  # Symbolic: math-verify's own comparison decides.
    if a.has(sympy.UnevaluatedExpr) or b.has(sympy.UnevaluatedExpr):
        return True  # A percentage (`50\%` is `50 * UnevaluatedExpr(1/100)`): see the docstring.
    rtol = _INEXACT_RTOL if a.has(sympy.Float) or b.has(sympy.Float) else _EXACT_RTOL
    try:
        va = sympy.N(a, _GUARD_DIGITS)
        vb = sympy.N(b, _GUARD_DIGITS)
        if not (va.is_finite and vb.is_finite):
            return False
        return bool(abs(va - vb) <= rtol * max(abs(va), abs(vb)))
    except Exception:  # noqa: BLE001  (fail closed)
        return False


def _install_numeric_guard():
    """Wraps `math_verify.grader.sympy_numeric_eq` with `_values_agree` (idempotent).

    `sympy_expr_eq` looks the function up as a module global at each call, so scalars, set and
    tuple elements, interval ends and matrix entries all go through the wrapper. Also silences
    math-verify's "timeout is disabled" warning: the deadline is the worker pool's.
    """
    from math_verify import grader

    with _guard_lock:
        upstream = grader.sympy_numeric_eq
        if getattr(upstream, "rlscale_guard", False):
            return
        logging.getLogger("math_verify").setLevel(logging.ERROR)

        def guarded(a, b, float_rounding, numeric_precision):
            return upstream(a, b, float_rounding, numeric_precision) and _values_agree(a, b)

        guarded.rlscale_guard = True
        grader.sympy_numeric_eq = guarded


def _as_math(answer: str) -> str:
    return f"${answer}$"


def check_answer(pred_answer: str, gold_answer: str) -> bool:
    """Whether an extracted answer equals the gold answer, by math-verify (plus the guard).

    Runs in the current process with no timeout: `MathVerifier` calls it in its worker
    processes; call it directly only on trusted input (debugging, tests).

    Args:
        pred_answer: The prediction, as returned by `extract_answer`.
        gold_answer: The reference answer, as returned by `extract_gold`.
    """
    import math_verify

    _install_numeric_guard()
    gold = math_verify.parse(
        _as_math(gold_answer),
        extraction_config=[math_verify.LatexExtractionConfig(), math_verify.ExprExtractionConfig()],
        parsing_timeout=None,
    )
    pred = math_verify.parse(
        _as_math(pred_answer),
        extraction_config=[math_verify.LatexExtractionConfig()],
        parsing_timeout=None,
    )
    if not gold or not pred:
        return False
    return bool(math_verify.verify(gold, pred, timeout_seconds=None))


def grade(completion: str, gold: str) -> float:
    """1.0 if the completion's final answer equals the gold answer, else 0.0, in this process.

    The whole check: `extract_answer`, `extract_gold`, the `MAX_ANSWER_CHARS` guard, then
    `check_answer` (math-verify with the numeric guard). It has no deadline: a hostile answer
    (a power tower) can run for minutes, so untrusted completions go through a worker pool that
    kills a check past its deadline, `rewards.isolation.verifier_pool` (with
    `isolation.score_isolated`) or `verify`. A module-level function, picklable by reference.

    Args:
        completion: The model's full completion.
        gold: The reference answer (or a MATH / GSM8K solution holding it).
    """
    answers, _ = _to_check(completion, gold)
    return float(answers is not None and check_answer(*answers))


def _warm_up():
    """Worker initializer: imports, the guard, and one check to build the LaTeX parser."""
    check_answer(r"\frac{1}{2}", "0.5")


# -- the verifier --------------------------------------------------------------------------------


def _default_num_workers() -> int:
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:
        cpus = os.cpu_count() or 1
    return max(1, min(8, cpus))


_POOL_STATS = ("timeouts", "errors", "crashes", "restarts")


@dataclasses.dataclass
class _Counts:
    samples: int = 0
    correct: int = 0
    no_answer: int = 0
    too_long: int = 0
    invalid_gold: int = 0


class MathVerifier:
    """Scores completions against gold answers in a pool of worker processes.

    Safe to share between threads, and usable inside worker processes (also daemonic ones,
    such as `multiprocessing.Pool` workers). Workers start when the verifier is built (well
    under a second with the fork server) and live until `close()` or interpreter exit. They
    never import the caller's main module (`rewards.worker`), so a script needs no
    `if __name__ == "__main__":` guard, and `python -c`, stdin and notebooks work alike.

    Args:
        num_workers: Worker processes (default: the usable CPUs, at most 8).
        timeout: Default seconds one check may take once a worker has it.
        start_method: 'forkserver' (default; restarts are fast forks of a warm server) or
            'spawn'.
        memory_limit_bytes: Address-space limit per worker, or None.
        check_fn: `(pred_answer, gold_answer) -> bool` run in the workers; a module-level
            function. Defaults to `check_answer`; tests swap in a faulty one.
    """

    def __init__(
        self,
        num_workers: int | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        *,
        start_method: str = "forkserver",
        memory_limit_bytes: int | None = DEFAULT_MEMORY_LIMIT_BYTES,
        check_fn: Callable[[str, str], bool] = check_answer,
    ):
        self.timeout = timeout
        self._pool = sandbox.WorkerPool(
            check_fn,
            num_workers or _default_num_workers(),
            initializer=_warm_up,
            start_method=start_method,
            preload=("math_verify", __name__),
            memory_limit_bytes=memory_limit_bytes,
        )
        self._lock = threading.Lock()
        self._counts = _Counts()

    def verify(self, completion: str, gold: str, timeout: float | None = None) -> float:
        """1.0 if the completion's final answer equals the gold answer, else 0.0."""
        return self.verify_batch([completion], [gold], timeout)[0]

    def verify_batch(
        self, completions: Sequence[str], golds: Sequence[str], timeout: float | None = None
    ) -> list[float]:
        """`grade(completions[i], golds[i])` for each i: the extraction here, the checks in
        parallel over the workers.

        Args:
            completions: Model completions.
            golds: Reference answers (bare answers, MATH solutions with `\\boxed{}` or GSM8K
                solutions with `####`), one per completion.
            timeout: Seconds each check may take (default: the verifier's).

        Returns:
            1.0 or 0.0 per completion; timeouts, errors and crashed workers give 0.0.
        """
        if len(completions) != len(golds):
            raise ValueError(f"{len(completions)} completions but {len(golds)} golds")
        scores = [0.0] * len(completions)
        jobs, job_index = [], []
        skipped = dict.fromkeys(("invalid_gold", "no_answer", "too_long"), 0)
        for i, (completion, gold) in enumerate(zip(completions, golds)):
            answers, reason = _to_check(completion, gold)
            if answers is None:
                skipped[reason] += 1
            else:
                jobs.append(answers)
                job_index.append(i)
        results = self._pool.map(jobs, timeout or self.timeout) if jobs else []
        for i, result in zip(job_index, results):
            if result.status == sandbox.OK and result.value:
                scores[i] = 1.0
        with self._lock:
            self._counts.samples += len(completions)
            self._counts.correct += int(sum(scores))
            self._counts.no_answer += skipped["no_answer"]
            self._counts.too_long += skipped["too_long"]
            self._counts.invalid_gold += skipped["invalid_gold"]
        return scores

    def stats(self) -> dict[str, int]:
        """Cumulative counters: samples, correct, no_answer, invalid_gold, timeouts, errors,
        crashes, restarts."""
        pool = self._pool.stats()
        with self._lock:
            counts = dataclasses.asdict(self._counts)
        return counts | {name: getattr(pool, name) for name in _POOL_STATS}

    def reset_stats(self):
        with self._lock:
            self._counts = _Counts()
        self._pool.reset_stats()

    def close(self):
        self._pool.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# -- module-level API on a shared default verifier ------------------------------------------------

_default: MathVerifier | None = None
_default_lock = threading.Lock()


def default_verifier() -> MathVerifier:
    """The process-wide verifier behind `verify` and `verify_batch`, built on first use."""
    global _default
    with _default_lock:
        if _default is None:
            _default = MathVerifier()
        return _default


def verify(completion: str, gold: str, timeout: float = DEFAULT_TIMEOUT) -> float:
    """1.0 if the completion's final answer equals the gold answer, else 0.0.

    Safe to call from any thread. The check runs in a worker process and counts as wrong if it
    takes longer than `timeout` seconds.

    Args:
        completion: The model's full completion.
        gold: The reference answer (or a MATH / GSM8K solution holding it).
        timeout: Seconds the check may take.
    """
    return default_verifier().verify(completion, gold, timeout)


def verify_batch(
    completions: Sequence[str], golds: Sequence[str], timeout: float = DEFAULT_TIMEOUT
) -> list[float]:
    """`verify` over a batch, in parallel over the default verifier's workers."""
    return default_verifier().verify_batch(completions, golds, timeout)


def stats() -> dict[str, int]:
    """The default verifier's cumulative counters (see `MathVerifier.stats`); zeros before the
    first `verify` call."""
    verifier = _default
    if verifier is not None:
        return verifier.stats()
    return dict.fromkeys([f.name for f in dataclasses.fields(_Counts)] + list(_POOL_STATS), 0)


def shutdown():
    """Stops the default verifier's workers; the next `verify` starts new ones."""
    global _default
    with _default_lock:
        verifier, _default = _default, None
    if verifier is not None:
        verifier.close()


atexit.register(shutdown)
