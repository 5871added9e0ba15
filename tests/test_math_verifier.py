"""Tests of `rlscale.rewards.math`: extraction rules, the audit, timeouts and fault isolation.

The audit (`-k audit -s` prints its table) compares the verifier with the hand labels of
`math_audit_corpus.py` and with an independent Hendrycks-style string match.
"""

import concurrent.futures
import multiprocessing
import os
import pathlib
import re
import signal
import threading
import time

import math_audit_corpus
import pytest

from rlscale.rewards import math as math_reward
from rlscale.rewards import sandbox

REPO = pathlib.Path(__file__).resolve().parents[1]
AUDIT_README = REPO / "experiments" / "verifier_audit" / "README.md"

# Fast enough for every legitimate check in the corpus (the slowest takes ~0.15 s alone).
AUDIT_TIMEOUT = 2.0
# The deadline of checks that never end (PATHOLOGICAL): they meet it on any machine.
TIMEOUT = 1.0
# The deadline of checks that end (well under a second each, more on a loaded machine): one
# they never meet, so that whether they time out does not depend on the machine's speed.
ENDS = 60.0
PATHOLOGICAL = r"The answer is $\boxed{9^{9^{9^{9}}}}$."

CRASH_MARKER = "CRASHWORKERNOW"
RAISE_MARKER = "RAISEINWORKER"
HANG_MARKER = "HANGINWORKER"


def faulty_check(pred_answer: str, gold_answer: str) -> bool:
    """`check_answer`, with faults injected by marker strings (runs in the workers)."""
    if CRASH_MARKER in pred_answer:
        os._exit(3)
    if RAISE_MARKER in pred_answer:
        raise RuntimeError("injected failure")
    if HANG_MARKER in pred_answer:
        time.sleep(600)
    return math_reward.check_answer(pred_answer, gold_answer)


def verify_in_pool_worker(completion: str, gold: str) -> tuple[float, bool]:
    """`verify` from inside a daemonic `multiprocessing.Pool` worker."""
    daemon = multiprocessing.current_process().daemon
    return math_reward.verify(completion, gold, timeout=TIMEOUT), daemon


def allocate_too_much() -> int:
    return len(bytearray(64 << 30))


@pytest.fixture(scope="module")
def default_verifier():
    """The module-level API's verifier, stopped after these tests."""
    yield math_reward.default_verifier()
    math_reward.shutdown()


@pytest.fixture(scope="module")
def faulty():
    with math_reward.MathVerifier(num_workers=2, timeout=ENDS, check_fn=faulty_check) as v:
        yield v


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _delta(before: dict, after: dict) -> dict:
    return {k: after[k] - before[k] for k in after if after[k] != before[k]}


# -- extraction -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "completion, answer",
    [
        (r"so $\boxed{5}$.", "5"),
        (r"\boxed{3} then \boxed{5}", "5"),
        (r"\fbox{7}", "7"),
        (r"\boxed{\frac{1}{\sqrt{2}}}", r"\frac{1}{\sqrt{2}}"),
        (r"\boxed{\{1, 2\}}", r"\{1, 2\}"),
        (r"\boxed{\boxed{4}}", "4"),
        (r"\boxed {6}", "6"),
        (r"\boxed{**13**}", "13"),
        (r"**$\boxed{13}$**", "13"),
        (r"\boxed{\frac{1}{2004!}}", r"\frac{1}{2004!}"),
        (r"\boxed{1\,000}", "1000"),
        (r"\boxed{}", None),
        (r"\boxed{5", None),
        (r"\boxed{5} and finally \boxed 6", None),
        (r"\boxed{5} then \boxedx", "5"),  # `\boxedx` is another command, not a box.
        ("Answer: 42", "42"),
        ("**Answer:** 42", "42"),
        ("## Final Answer: $x = 3$", "x = 3"),
        ("Answer:\n\n42", "42"),
        ("So the answer is 42.", "42"),
        ("The answer is: (1, 2].", "(1, 2]"),
        ("The answer is \\(\\frac12\\).", r"\frac12"),
        ("The final answer is $5$. I hope it is correct.", "5"),
        ("The answer is $5.", "5"),
        ("The answer is $5", "5"),
        ("The answer is $x+1", None),  # An unclosed math span.
        ("The answer is 12 apples.", "12"),
        ("The answer is 1.5e3.", r"1.5\times 10^{3}"),
        ("The answer is \u22123.", "-3"),
        ("The answer is 4.\nThe answer is 6.", "6"),
        ("\\boxed{5}\nThe answer is 6.", "5"),
        ("It is 5. My answer: 5", None),
        ("The total is 5.", None),
        ("5", None),
        ("", None),
        ("<think>\\boxed{5}</think>\\boxed{6}", "6"),
        ("<think>\\boxed{5}</think>", None),
        ("<think>\\boxed{5}", None),
        ("<think>a</think>\\boxed{1}</think>\\boxed{2}", "2"),
        ("draft</think>Answer: 8", "8"),
    ],
)
def test_extract_answer(completion, answer):
    assert math_reward.extract_answer(completion) == answer


@pytest.mark.parametrize(
    "gold, answer",
    [
        ("5", "5"),
        ("$\\frac{1}{2}$", r"\frac{1}{2}"),
        (r"so it is $\boxed{\frac{1}{2}}$.", r"\frac{1}{2}"),
        ("Add them.\n#### 1,234", "1,234"),
        ("", ""),
    ],
)
def test_extract_gold(gold, answer):
    assert math_reward.extract_gold(gold) == answer


def test_no_eval_exec_or_sympify_in_our_code():
    for path in (REPO / "rlscale" / "rewards").glob("*.py"):
        source = path.read_text()
        assert not re.search(r"\b(eval|exec|sympify|parse_expr)\s*\(", source), path


# -- the audit ------------------------------------------------------------------------------------


@pytest.mark.slow
def test_audit(default_verifier):
    cases = math_audit_corpus.corpus()
    assert len(cases) >= 300
    assert sum(c.trap for c in cases) >= 100
    before = math_reward.stats()
    # The pathological checks never end: each spins a worker until its deadline, so they get
    # the shorter deadline of checks that never end (`TIMEOUT`), the rest `AUDIT_TIMEOUT`.
    patho = [c.id.startswith("patho-") for c in cases]
    scores = [None] * len(cases)
    for is_patho, timeout in ((False, AUDIT_TIMEOUT), (True, TIMEOUT)):
        index = [i for i, p in enumerate(patho) if p == is_patho]
        got = math_reward.verify_batch(
            [cases[i].completion for i in index], [cases[i].gold for i in index], timeout=timeout
        )
        for i, score in zip(index, got):
            scores[i] = score
    timeouts = _delta(before, math_reward.stats()).get("timeouts", 0)
    first = list(scores)
    # On a machine loaded many times over its cores, a legitimate check can pass the deadline
    # (the slowest takes ~0.15 s alone) and score 0: each legitimate case that missed its
    # label is checked again, with 10 times the deadline. A wrong verdict stays wrong (the
    # check is deterministic); a late one gets its verdict.
    late = [i for i, c in enumerate(cases) if not c.id.startswith("patho-")]
    late = [i for i in late if scores[i] != cases[i].expected]
    if late:
        again = math_reward.verify_batch(
            [cases[i].completion for i in late],
            [cases[i].gold for i in late],
            timeout=10 * AUDIT_TIMEOUT,
        )
        scores = list(scores)
        for i, score in zip(late, again):
            scores[i] = score
    rows = math_audit_corpus.audit(scores, cases)
    table = math_audit_corpus.report(rows)
    print("\n" + table)
    if os.environ.get("RLSCALE_AUDIT_REPORT"):
        pathlib.Path(os.environ["RLSCALE_AUDIT_REPORT"]).write_text(table + "\n")

    wrong = [
        (r.case.id, r.case.expected, r.verifier) for r in rows if r.verifier != r.case.expected
    ]
    assert not wrong, wrong
    # The pathological cases timed out, and nothing else did but legitimate checks that
    # scored 0 on the first pass: on a loaded machine one can pass its deadline, and a late
    # check scores 0 (those labelled 1 are the late ones checked again above; those
    # labelled 0 got their verdict either way).
    n_patho = sum(c.id.startswith("patho-") for c in cases)
    zeros = sum(first[i] == 0 for i, c in enumerate(cases) if not c.id.startswith("patho-"))
    assert n_patho <= timeouts <= n_patho + zeros
    assert _delta(before, math_reward.stats()).get("timeouts", 0) == timeouts

    # The README documents exactly the current disagreements.
    disagree = {r.case.id for r in rows if r.verifier != r.string_match}
    readme = AUDIT_README.read_text()
    start = readme.index(math_audit_corpus.DISAGREEMENTS_START)
    section = readme[start : readme.index(math_audit_corpus.DISAGREEMENTS_END, start)]
    documented = set(re.findall(r"^\| ([a-z0-9.\-]+) \| ", section, re.M)) - {"id", "---"}
    assert documented == disagree, (
        f"README out of date (regenerate with `PYTHONPATH=. python tests/math_audit_corpus.py`); "
        f"undocumented: {sorted(disagree - documented)}, stale: {sorted(documented - disagree)}"
    )


def test_known_false_negatives_still_fail():
    """These are wrong today; if one passes, move it into the corpus with its label."""
    for case in math_audit_corpus.KNOWN_FALSE_NEGATIVES:
        answer = math_reward.extract_answer(case.completion)
        assert not math_reward.check_answer(answer, math_reward.extract_gold(case.gold)), case.id


def test_numeric_guard_in_process():
    # math-verify alone accepts these (its evalf(chop=True) zeroes tiny differences).
    assert not math_reward.check_answer(r"\frac{1}{2004!}", r"\frac{1}{2006!}")
    assert not math_reward.check_answer(r"10^{-20}", r"2\cdot 10^{-20}")
    assert math_reward.check_answer(r"\frac{1}{2006!}", r"\frac{1}{2006!}")
    assert math_reward.check_answer("0.333333", r"\frac{1}{3}")


# -- the module-level API: threads and timeouts ---------------------------------------------------


def test_verify_basics(default_verifier):
    assert math_reward.verify(r"\boxed{\frac{2}{4}}", "0.5") == 1.0
    assert math_reward.verify(r"\boxed{-3}", "3") == 0.0
    assert math_reward.verify_batch([], []) == []
    with pytest.raises(ValueError):
        math_reward.verify_batch(["a"], [])


def test_no_answer_scores_zero_without_a_worker(default_verifier):
    before = math_reward.stats()
    assert math_reward.verify("The total is 5.", "5") == 0.0
    assert math_reward.verify("<think>so \\boxed{5}", "5") == 0.0
    assert math_reward.verify(r"\boxed{5}", "") == 0.0
    delta = _delta(before, math_reward.stats())
    assert delta == {"samples": 3, "no_answer": 2, "invalid_gold": 1}


def test_think_rules(default_verifier):
    completions = [
        "<think>It is \\boxed{5}.</think> The answer is \\boxed{6}.",
        "<think>It is \\boxed{5}.</think> The answer is \\boxed{6}.",
        "<think>It is \\boxed{5}.",
        "<think>a</think> \\boxed{5} </think> \\boxed{6}",
    ]
    golds = ["6", "5", "5", "6"]
    assert math_reward.verify_batch(completions, golds) == [1.0, 0.0, 0.0, 1.0]


def test_timeout_in_main_thread_kills_and_replaces_the_worker(default_verifier):
    pool = default_verifier._pool
    pids = set(pool.worker_pids())
    before = math_reward.stats()
    assert math_reward.verify(PATHOLOGICAL, "5", timeout=TIMEOUT) == 0.0
    delta = _delta(before, math_reward.stats())
    assert delta == {"samples": 1, "timeouts": 1, "restarts": 1}  # Cut off at its deadline.
    (stuck,) = pids - set(pool.worker_pids())
    assert not _exists(stuck)  # Killed and reaped.
    assert math_reward.verify(r"\boxed{5}", "5") == 1.0


def test_timeout_in_a_thread(default_verifier):
    out = []
    before = math_reward.stats()
    thread = threading.Thread(
        target=lambda: out.append(math_reward.verify(PATHOLOGICAL, "5", timeout=TIMEOUT))
    )
    thread.start()
    thread.join(timeout=ENDS)  # Only against a hang: the deadline ends the call.
    assert out == [0.0]
    assert _delta(before, math_reward.stats()) == {"samples": 1, "timeouts": 1, "restarts": 1}
    assert math_reward.verify(r"\boxed{5}", "5") == 1.0


def test_timeout_in_a_thread_pool(default_verifier):
    """Four threads share the verifier's workers: the two checks that never end are cut off
    at their deadline, and the calls queued behind them (a deadline starts when a worker
    takes the call) still score."""
    jobs = [
        (PATHOLOGICAL, "5", 0.0, TIMEOUT),
        (r"\boxed{\frac{1}{\sqrt{2}}}", r"\frac{\sqrt{2}}{2}", 1.0, ENDS),
        (r"\boxed{10^{10^{10}}}", "5", 0.0, TIMEOUT),
        ("Answer: 7", "7", 1.0, ENDS),
        (r"\boxed{(1, 2]}", "[1, 2]", 0.0, ENDS),
        (r"\boxed{x = 5}", "5", 1.0, ENDS),
    ]
    before = math_reward.stats()
    with concurrent.futures.ThreadPoolExecutor(max_workers=4) as executor:
        futures = [executor.submit(math_reward.verify, c, g, t) for c, g, _, t in jobs]
        results = [f.result(timeout=4 * ENDS) for f in futures]  # Only against a hang.
    assert results == [e for _, _, e, _ in jobs]
    delta = _delta(before, math_reward.stats())
    assert delta == {"samples": 6, "correct": 3, "timeouts": 2, "restarts": 2}


# -- fault isolation (a verifier whose check function misbehaves on markers) ----------------------


def test_worker_crash_costs_one_sample(faulty):
    before = faulty.stats()
    completions = [
        r"\boxed{5}",
        rf"\boxed{{{CRASH_MARKER}}}",
        r"\boxed{\frac{1}{2}}",
        rf"\boxed{{{CRASH_MARKER}}}",
        "Answer: 7",
    ]
    golds = ["5", "5", "0.5", "5", "7"]
    assert faulty.verify_batch(completions, golds) == [1.0, 0.0, 1.0, 0.0, 1.0]
    delta = _delta(before, faulty.stats())
    assert delta == {"samples": 5, "correct": 3, "crashes": 2, "restarts": 2}
    assert faulty.verify(r"\boxed{5}", "5") == 1.0


def test_exception_costs_one_sample(faulty):
    before = faulty.stats()
    completions = [rf"\boxed{{{RAISE_MARKER}}}", r"\boxed{5}", rf"\boxed{{{RAISE_MARKER}}}"]
    assert faulty.verify_batch(completions, ["5", "5", "5"]) == [0.0, 1.0, 0.0]
    delta = _delta(before, faulty.stats())
    assert delta == {"samples": 3, "correct": 1, "errors": 2}  # No restart: the worker lives on.


def test_worker_killed_from_outside_mid_call(faulty):
    assert faulty.verify_batch([r"\boxed{1}", r"\boxed{2}"], ["1", "2"]) == [1.0, 1.0]  # All ready.
    before = faulty.stats()
    out = []
    thread = threading.Thread(
        target=lambda: out.append(faulty.verify(rf"\boxed{{{HANG_MARKER}}}", "5", timeout=60))
    )
    thread.start()
    time.sleep(0.5)
    pids = faulty._pool.worker_pids()
    for pid in pids:  # The busy worker and the idle one.
        os.kill(pid, signal.SIGKILL)
    thread.join(timeout=10)
    assert out == [0.0]
    # An idle worker's death is only seen when a call is sent to it; a worker that is still
    # dying then would take that call with it. Once it is gone, no call is lost.
    deadline = time.monotonic() + 10
    while any(_exists(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert faulty.verify_batch([r"\boxed{3}", r"\boxed{4}"], ["3", "4"]) == [1.0, 1.0]
    delta = _delta(before, faulty.stats())
    assert delta["crashes"] == 1 and delta["restarts"] == 2 and "timeouts" not in delta


def test_verify_inside_a_daemonic_pool_worker():
    jobs = [(PATHOLOGICAL, "5"), (r"\boxed{5}", "5")]
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        assert pool.starmap(verify_in_pool_worker, jobs) == [(0.0, True), (1.0, True)]


def test_spawn_start_method():
    with math_reward.MathVerifier(num_workers=1, start_method="spawn") as verifier:
        assert verifier.verify_batch([r"\boxed{0.5}", r"\boxed{3}"], [r"\frac12", "4"]) == [
            1.0,
            0.0,
        ]


def test_memory_limit_fails_one_call():
    with sandbox.WorkerPool(allocate_too_much, 1, memory_limit_bytes=2 << 30) as pool:
        (result,) = pool.map([()], timeout=30)
    assert result.status == sandbox.ERROR and "MemoryError" in result.error


@pytest.mark.parametrize(
    "completion,gold,outcome",
    [
        # A 10,000-digit number: no real answer is that long, so it is never parsed.
        ("The answer is \\boxed{" + "7" * 10_000 + "}", "7", {"too_long": 1}),
        # A power tower: math-verify would evaluate it for minutes; cut off at the deadline.
        ("\\boxed{10^{10^{10}}}", "100", {"timeouts": 1, "restarts": 1}),
        # 5,000 nested braces.
        ("\\boxed{" + "{" * 5000 + "1" + "}" * 5000 + "}", "1", {"too_long": 1}),
        # A 1 MB string: its answer is checked (and wrong).
        ("x" * (1 << 20) + " \\boxed{4}", "3", {}),
    ],
    ids=["10k_digits", "power_tower", "nested_braces", "1MB"],
)
def test_adversarial_answers_score_zero_in_bounded_time(
    default_verifier, completion, gold, outcome
):
    """Each is bounded by a limit the code enforces, not by the machine's speed: an answer
    over `MAX_ANSWER_CHARS` is never parsed, and a check runs in a worker killed at its
    deadline (1.5 s by default). The counters say which limit held."""
    before = math_reward.stats()
    assert math_reward.verify(completion, gold) == 0.0
    assert _delta(before, math_reward.stats()) == {"samples": 1, **outcome}


def test_answer_extraction_is_linear_in_the_completion():
    """Extraction runs in the caller, before any deadline, so it must take time linear in the
    completion: `_SCI_RE` used to backtrack quadratically on a long run of digits (2.5 s for
    the 10,000-digit answer above). 100,000 digits, extracted in a worker with a deadline of
    over 100 times what linear extraction takes (0.2 s on a loaded 2-core machine) and about
    a tenth of what the quadratic one took."""
    digits = "7" * 100_000
    with sandbox.WorkerPool(math_reward.extract_answer, 1) as pool:
        (result,) = pool.map([(f"The answer is \\boxed{{{digits}}}",)], timeout=30.0)
    assert result.status == sandbox.OK and result.value == digits
