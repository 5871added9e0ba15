"""Audit corpus for `rlscale.rewards.math`, and an independent string-match checker.

`corpus()` returns hand-labelled (completion, gold, expected) cases: the known traps, written
out one by one, and ordinary GSM8K/MATH-style pairs generated from a fixed seed. `string_match`
is the second, independent check: the Hendrycks-MATH recipe (extract the last `\\boxed{}`,
normalize both strings, compare them), written from its description, not copied. `audit` runs
both over the corpus and collects the pairs where they disagree.

Regenerate the table in `experiments/verifier_audit/README.md`:

    PYTHONPATH=. python tests/math_audit_corpus.py
"""

from __future__ import annotations

import dataclasses
import random
import re
from fractions import Fraction
from math import gcd


@dataclasses.dataclass(frozen=True)
class Case:
    """One audit pair.

    Attributes:
        id: Stable name, used in the README table.
        completion: The model completion.
        gold: The dataset's reference answer.
        expected: The hand label: 1.0 if the completion is correct, else 0.0.
        note: Why `expected` is what it is (shown where the two checkers disagree).
        trap: Whether this is one of the known traps (the rest is generated bulk).
    """

    id: str
    completion: str
    gold: str
    expected: float
    note: str
    trap: bool = True


def _boxed(answer: str, lead: str = "Working through the steps gives the result.") -> str:
    return f"{lead}\n\nSo the final answer is $\\boxed{{{answer}}}$."


# (id, completion, gold, expected, note). Completions written as bare answers go in a box.
_TRAPS = [
    # Signs.
    ("sign-neg-vs-pos", _boxed("-3"), "3", 0, "-3 is not 3"),
    ("sign-pos-vs-neg", _boxed("3"), "-3", 0, "3 is not -3"),
    ("sign-neg-ok", _boxed("-3"), "-3", 1, "same value"),
    ("sign-unicode-minus", "The answer is \u22123.", "-3", 1, "U+2212 minus is a minus sign"),
    ("sign-neg-frac", _boxed(r"\frac{-1}{2}"), r"-\frac{1}{2}", 1, "sign on numerator"),
    ("sign-neg-frac-wrong", _boxed(r"\frac{1}{2}"), r"-\frac{1}{2}", 0, "sign dropped"),
    # Tiny and huge exact numbers.
    (
        "fact-2004-vs-2006",
        _boxed(r"\frac{1}{2004!}"),
        r"\frac{1}{2006!}",
        0,
        "different numbers; math-verify alone says equal (evalf chop), caught by the guard",
    ),
    ("fact-2006-ok", _boxed(r"\frac{1}{2006!}"), r"\frac{1}{2006!}", 1, "same expression"),
    ("fact-slash-form", _boxed("1/2006!"), r"\frac{1}{2006!}", 1, "a/b is a fraction"),
    ("fact-big-ratio", _boxed(r"\frac{2006!}{2004!}"), r"2006\cdot 2005", 1, "exact ratio"),
    ("fact-2004-vs-2006-int", _boxed("2004!"), "2006!", 0, "different integers"),
    (
        "tiny-power-of-ten",
        _boxed(r"10^{-20}"),
        r"2\cdot 10^{-20}",
        0,
        "half the value; math-verify alone says equal (evalf chop), caught by the guard",
    ),
    (
        "near-one-exact",
        _boxed(r"\frac{10^{20}}{10^{20}+1}"),
        "1",
        0,
        "exact answers must be exactly equal, not within 1e-15",
    ),
    ("tiny-decimal-vs-zero", _boxed("0.0000001"), "0", 0, "1e-7 is not 0"),
    ("tiny-decimals", _boxed("0.000124"), "0.000123", 0, "differ by 0.8%"),
    (
        "tiny-exact-vs-rounded-gold",
        _boxed(r"\frac{1}{8100}"),
        "0.000123",
        1,
        "exact value of a gold rounded to 3 significant digits (0.4% off)",
    ),
    # Unreduced fractions: the reward is about the value.
    ("frac-unreduced", _boxed(r"\frac{2}{4}"), r"\frac{1}{2}", 1, "decision: value counts"),
    ("frac-unreduced-gold", _boxed(r"\frac{1}{2}"), r"\frac{2}{4}", 1, "decision: value counts"),
    ("frac-unreduced-big", _boxed(r"\frac{6}{8}"), r"\frac{3}{4}", 1, "decision: value counts"),
    ("frac-shorthand", _boxed(r"\frac12"), r"\frac{1}{2}", 1, r"\frac12 is \frac{1}{2}"),
    ("frac-dfrac", _boxed(r"\dfrac{3}{4}"), r"\frac{3}{4}", 1, r"\dfrac is \frac"),
    ("frac-tfrac", _boxed(r"\tfrac{3}{4}"), r"\frac{3}{4}", 1, r"\tfrac is \frac"),
    ("frac-wrong", _boxed(r"\frac{3}{5}"), r"\frac{3}{4}", 0, "different value"),
    ("frac-mixed-number", _boxed(r"2\frac{1}{3}"), r"\frac{7}{3}", 1, "mixed number 2 1/3"),
    # Text wrappers and markdown.
    ("text-13", _boxed(r"\text{13}"), "13", 1, r"\text{} is a wrapper"),
    ("textbf-13", _boxed(r"\textbf{13}"), "13", 1, r"\textbf{} is a wrapper"),
    ("mathbf-13", _boxed(r"\mathbf{13}"), "13", 1, r"\mathbf{} is a wrapper"),
    ("text-13-wrong", _boxed(r"\text{14}"), "13", 0, "different value"),
    ("bold-inside-box", _boxed("**13**"), "13", 1, "markdown bold inside the box is stripped"),
    ("bold-outside-box", r"Total: **$\boxed{13}$**", "13", 1, "markdown around the box"),
    ("bold-answer-line", "So we get 12 + 1.\n\nThe answer is **13**.", "13", 1, "bold answer"),
    ("bold-answer-label", "Adding up gives 13.\n\n**Answer:** 13", "13", 1, "bold label"),
    ("bold-wrong", "Adding up gives 13.\n\nThe answer is **12**.", "13", 0, "wrong value"),
    # Nested and escaped braces.
    (
        "nested-inv-sqrt2",
        _boxed(r"\frac{1}{\sqrt{2}}"),
        r"\frac{\sqrt{2}}{2}",
        1,
        "rationalized form of the same value",
    ),
    ("nested-inv-sqrt3", _boxed(r"\frac{1}{\sqrt{3}}"), r"\frac{\sqrt{2}}{2}", 0, "different"),
    ("nested-sqrt-frac", _boxed(r"\sqrt{\frac{1}{2}}"), r"\frac{\sqrt{2}}{2}", 1, "same value"),
    ("nested-power-half", _boxed(r"2^{\frac{1}{2}}"), r"\sqrt{2}", 1, "2^(1/2) = sqrt 2"),
    ("nested-deep", _boxed(r"\frac{\sqrt{\frac{9}{4}}}{3}"), r"\frac{1}{2}", 1, "(3/2)/3"),
    ("escaped-braces-set", _boxed(r"\{1, 2\}"), r"\{1,2\}", 1, r"\{ \} are not box braces"),
    # Decimals and fractions.
    ("half-decimal", _boxed("0.5"), r"\frac{1}{2}", 1, "0.5 = 1/2"),
    ("half-decimal-trailing-zero", _boxed("0.50"), r"\frac{1}{2}", 1, "0.50 = 1/2"),
    ("half-leading-dot", _boxed(".5"), r"\frac{1}{2}", 1, ".5 = 1/2"),
    ("half-close-wrong", _boxed("0.49"), r"\frac{1}{2}", 0, "0.49 != 1/2"),
    ("third-6-places", _boxed("0.333333"), r"\frac{1}{3}", 1, "decision: 6 decimal places"),
    ("third-2-places", _boxed("0.33"), r"\frac{1}{3}", 0, "decision: too coarse"),
    ("pi-3.14", _boxed("3.14"), r"\pi", 0, "decision: too coarse"),
    ("sqrt2-6-places", _boxed("1.414214"), r"\sqrt{2}", 1, "decision: 6 decimal places"),
    ("sqrt2-2-places", _boxed("1.41"), r"\sqrt{2}", 0, "decision: too coarse"),
    ("int-as-decimal", _boxed("10.0"), "10", 1, "10.0 = 10"),
    ("int-near-decimal", _boxed("2.9999999"), "3", 0, "decision: 6 decimal places"),
    # Percentages.
    ("pct-vs-decimal", _boxed(r"50\%"), "0.5", 1, "decision: 50% = 0.5"),
    ("pct-vs-number", _boxed(r"50\%"), "50", 1, "decision: the % sign is not required"),
    ("pct-gold-decimal-pred", _boxed("0.5"), r"50\%", 1, "decision: 50% = 0.5"),
    ("pct-gold-number-pred", _boxed("50"), r"50\%", 1, "decision: the % sign is not required"),
    ("pct-wrong", _boxed(r"5\%"), "0.5", 0, "5% is 0.05"),
    ("pct-plain-sign", "The answer is 25%.", "25", 1, "plain % sign"),
    # Intervals.
    ("interval-open-closed", _boxed("(1, 2]"), "[1, 2]", 0, "endpoint 1 excluded"),
    ("interval-same", _boxed("[1,2]"), "[1, 2]", 1, "same interval"),
    ("interval-left-right", _boxed(r"\left[1, 2\right)"), "[1, 2)", 1, r"\left \right"),
    ("interval-infinity", _boxed(r"(-\infty, 3)"), r"(-\infty, 3]", 0, "3 excluded"),
    ("interval-infinity-ok", _boxed(r"(-\infty,3]"), r"(-\infty, 3]", 1, "same"),
    ("interval-union", _boxed(r"[1,2)\cup(3,4]"), r"[1,2) \cup (3,4]", 1, "same union"),
    ("interval-union-wrong", _boxed(r"[1,2]\cup(3,4]"), r"[1,2) \cup (3,4]", 0, "2 included"),
    (
        "interval-vs-inequality",
        _boxed("x > 5"),
        r"(5, \infty)",
        0,
        "decision (math-verify): an inequality never matches an interval gold, since "
        "'(a, b)' golds are also ordered pairs",
    ),
    ("inequality-vs-interval", _boxed(r"(5,\infty)"), "x > 5", 1, "interval for inequality"),
    ("inequality-same", _boxed("x>5"), "x > 5", 1, "same inequality"),
    ("inequality-strictness", _boxed(r"x \ge 5"), "x > 5", 0, "5 included"),
    # Tuples.
    ("tuple-same", _boxed("(3, 4)"), "(3,4)", 1, "same pair"),
    ("tuple-swapped", _boxed("(4, 3)"), "(3,4)", 0, "order matters"),
    ("tuple-left-right", _boxed(r"\left( 3, 4 \right)"), "(3,4)", 1, r"\left( \right)"),
    ("tuple-length", _boxed("(1, 2, 3)"), "(1,2)", 0, "different length"),
    ("tuple-triple", _boxed("(1,-2,3)"), "(1, -2, 3)", 1, "same triple"),
    ("tuple-bare", _boxed("3, 4"), "(3,4)", 1, "bare list in the gold's order"),
    ("tuple-bare-swapped", _boxed("4, 3"), "(3,4)", 0, "order matters"),
    (
        "tuple-as-set",
        _boxed(r"\{3, 4\}"),
        "(3,4)",
        1,
        "decision (math-verify): a set in the gold's order matches a pair, as the bare "
        "'3, 4' must and both parse to the same set",
    ),
    # Equations.
    ("eq-pred-assignment", _boxed("x = 5"), "5", 1, "x = 5 states the value 5"),
    ("eq-gold-assignment", _boxed("5"), "x = 5", 1, "value of the gold's assignment"),
    (
        "eq-other-variable",
        _boxed("y = 5"),
        "x = 5",
        0,
        "different variable; the string match drops any short left-hand side",
    ),
    ("eq-negative", _boxed("x = -5"), "5", 0, "-5 is not 5"),
    ("eq-line", _boxed("y = 1 + 2x"), "y = 2x + 1", 1, "same line"),
    ("eq-line-rhs", _boxed("2x + 1"), "y = 2x + 1", 1, "right-hand side of the gold"),
    ("eq-line-wrong", _boxed("y = 2x - 1"), "y = 2x + 1", 0, "different line"),
    # Sets.
    ("set-reordered", _boxed(r"\{2, 1\}"), r"\{1, 2\}", 1, "sets are unordered"),
    ("set-extra", _boxed(r"\{1, 2, 3\}"), r"\{1, 2\}", 0, "extra element"),
    ("set-bare-list", _boxed("2, 1"), r"\{1, 2\}", 1, "list of the solutions"),
    ("set-and-words", _boxed(r"1 \text{ and } 2"), r"\{1, 2\}", 1, "'1 and 2' lists both"),
    ("set-roots-order", _boxed("3, 2"), "2, 3", 1, "roots in any order"),
    ("set-empty", _boxed(r"\varnothing"), r"\emptyset", 1, r"\varnothing = \emptyset"),
    # Multiple boxes.
    ("multi-box-last-wins", r"First \boxed{3}, then corrected: \boxed{5}.", "5", 1, "last box"),
    ("multi-box-first-ignored", r"First \boxed{3}, then corrected: \boxed{5}.", "3", 0, "last box"),
    ("nested-box", r"$\boxed{\boxed{5}}$", "5", 1, "innermost is the last box"),
    ("fbox", r"Hence $\fbox{7}$.", "7", 1, r"\fbox counts as a box"),
    ("box-with-space", r"Hence $\boxed {7}$.", "7", 1, r"space before the brace"),
    # Units.
    ("units-cm", _boxed(r"5\text{ cm}"), "5", 1, "units are ignored"),
    ("units-cm-nospace", _boxed(r"5 \text{cm}"), "5", 1, "units are ignored"),
    ("units-cm2", _boxed(r"5\text{ cm}^2"), "5", 1, "units are ignored"),
    ("units-wrong-value", _boxed(r"6\text{ cm}"), "5", 0, "wrong value"),
    (
        "units-wrong-unit",
        _boxed(r"5\text{ m}"),
        r"5\text{ cm}",
        1,
        "decision (math-verify): units are dropped on both sides, so a wrong unit passes",
    ),
    ("units-dollars", _boxed(r"\$18.90"), "18.90", 1, "currency sign"),
    ("units-words", "The answer is 12 apples.", "12", 1, "prose after the number"),
    # Thousands separators.
    ("thousands-comma", _boxed("1,000"), "1000", 1, "thousands separator"),
    ("thousands-braced", _boxed("1{,}000"), "1000", 1, "thousands separator"),
    ("thousands-thin-space", _boxed(r"1\,000"), "1000", 1, "thin-space separator"),
    ("thousands-million", _boxed("1,000,000"), "1000000", 1, "thousands separators"),
    ("thousands-gold", _boxed("1000"), "1,000", 1, "separator in the gold"),
    ("thousands-gsm8k", _boxed("1234"), "Add them up.\n#### 1,234", 1, "GSM8K gold"),
    ("thousands-wrong", _boxed("1,001"), "1000", 0, "different value"),
    # Degrees.
    ("deg-circ", _boxed(r"30^\circ"), "30", 1, "degree sign ignored"),
    ("deg-circ-braced", _boxed(r"30^{\circ}"), "30", 1, "degree sign ignored"),
    ("deg-unicode", "The answer is 30\u00b0.", "30", 1, "degree sign ignored"),
    ("deg-wrong", _boxed(r"45^\circ"), "30", 0, "different angle"),
    (
        "deg-vs-radians",
        _boxed(r"\frac{\pi}{6}"),
        r"30^\circ",
        0,
        "decision (math-verify): degrees are not converted to radians",
    ),
    # Negative zero and scientific notation.
    ("neg-zero", _boxed("-0"), "0", 1, "-0 = 0"),
    ("neg-zero-decimal", _boxed("-0.0"), "0", 1, "-0.0 = 0"),
    ("sci-times", _boxed(r"1.5 \times 10^{3}"), "1500", 1, "1.5e3"),
    ("sci-cdot", _boxed(r"1.5\cdot 10^3"), "1500", 1, "1.5e3"),
    ("sci-e-notation", "The answer is 1.5e3.", "1500", 1, "e-notation is rewritten"),
    ("sci-wrong", _boxed(r"2 \times 10^{3}"), "1500", 0, "different value"),
    ("sci-avogadro", _boxed(r"6.02\times10^{23}"), r"6.02 \times 10^{23}", 1, "same value"),
    ("sci-tiny-wrong", "The answer is 1e-7.", r"2 \times 10^{-7}", 0, "half the value"),
    # Pathological: must time out (or fail) and score 0, never hang.
    ("patho-tower-9", _boxed(r"9^{9^{9^{9}}}"), "5", 0, "times out"),
    ("patho-tower-2", _boxed(r"2^{2^{2^{2^{2^{2^{2}}}}}}"), "5", 0, "times out"),
    ("patho-googolplex-ish", _boxed(r"10^{10^{10}}"), "5", 0, "times out"),
    ("patho-factorial", _boxed(r"(10^{10^{10}})!"), "5", 0, "times out"),
    ("patho-tower-symbolic", _boxed(r"9^{9^{9^{9}}}"), "x + 1", 0, "times out"),
    ("long-sum", _boxed("+".join(["1"] * 200)), "200", 1, "long but easy: 200 ones"),
    # The reasoning format.
    (
        "think-after-wins",
        "<think>Maybe \\boxed{5}?</think>\nThe answer is $\\boxed{6}$.",
        "6",
        1,
        "only the text after </think> counts",
    ),
    (
        "think-inside-ignored",
        "<think>Maybe \\boxed{5}?</think>\nThe answer is $\\boxed{6}$.",
        "5",
        0,
        "the box inside <think> is ignored",
    ),
    ("think-unclosed", "<think>So the answer is \\boxed{5}", "5", 0, "no </think>: no answer"),
    (
        "think-nothing-after",
        "<think>So the answer is \\boxed{5}</think>",
        "5",
        0,
        "nothing after </think>",
    ),
    (
        "think-last-close",
        "<think>a</think> draft \\boxed{4} </think> final \\boxed{7}",
        "7",
        1,
        "text after the last </think>",
    ),
    (
        "think-close-only",
        "reasoning \\boxed{4}</think>Answer: 8",
        "8",
        1,
        "a </think> without <think> still splits",
    ),
    # No answer, malformed answers.
    ("none-bare-number", "5", "5", 0, "fail closed: no box, no answer line"),
    ("none-number-in-text", "The total is 5 apples.", "5", 0, "fail closed: never any number"),
    ("none-empty-box", r"The answer is \boxed{}.", "5", 0, "empty box"),
    ("none-unclosed-box", r"So \boxed{5", "5", 0, "unbalanced box (truncated)"),
    (
        "none-box-no-brace",
        r"Earlier \boxed{5}. Final: \boxed 5",
        "5",
        0,
        r"decision: a box without {...} is malformed, and an earlier box is never used instead",
    ),
    (
        "none-midline-answer-colon",
        "It is 5. My answer: 5",
        "5",
        0,
        "decision: 'Answer:' must start a line",
    ),
    # Answer lines.
    ("line-answer-colon", "We find it.\nAnswer: 42", "42", 1, "Answer: line"),
    ("line-answer-next-line", "We find it.\nAnswer:\n\n42\n", "42", 1, "answer on the next line"),
    ("line-answer-is", "Therefore, the answer is 42.", "42", 1, "'the answer is'"),
    (
        "line-minerva",
        "Final Answer: The final answer is $\\frac{1}{2}$. I hope it is correct.",
        "0.5",
        1,
        "Minerva format",
    ),
    ("line-currency", "The answer is $5.", "5", 1, "unclosed $ before a digit is currency"),
    ("line-math-paren", "The answer is \\(\\frac{1}{4}\\).", "0.25", 1, r"\( \) math"),
    ("line-math-bracket", "The answer is \\[x = 3\\]", "3", 1, r"\[ \] math"),
    (
        "line-prose-after",
        "The answer is 7 because 2 + 3 = 5.",
        "5",
        0,
        "the answer ends at the first prose word",
    ),
    ("line-last-wins", "The answer is 4.\nWait, recheck.\nThe answer is 6.", "6", 1, "last"),
    (
        "box-beats-line",
        "\\boxed{5}\nThe answer is 6.",
        "5",
        1,
        "a box, when present, is the answer",
    ),
    # Gold formats.
    ("gold-math-solution", _boxed("5"), r"so the total is $\boxed{5}$.", 1, "MATH solution"),
    ("gold-dollars", _boxed("5"), r"$5$", 1, "gold in math delimiters"),
    # Text answers.
    ("text-weekday", _boxed(r"\text{Monday}"), r"\text{Monday}", 1, "same word"),
    ("text-weekday-wrong", _boxed(r"\text{Tuesday}"), r"\text{Monday}", 0, "different word"),
    ("text-choice", _boxed(r"\text{(B)}"), "B", 1, "multiple-choice letter"),
    ("text-choice-wrong", _boxed("B"), r"\text{(C)}", 0, "different letter"),
    # Algebra.
    ("alg-factored", _boxed("(x+1)^2"), "x^2 + 2x + 1", 1, "same polynomial"),
    ("alg-factored-wrong", _boxed("(x-1)^2"), "x^2 + 2x + 1", 0, "different polynomial"),
    ("alg-sqrt-simplify", _boxed(r"\sqrt{12}"), r"2\sqrt{3}", 1, "same value"),
    ("alg-complex", _boxed("4i + 3"), "3 + 4i", 1, "same complex number"),
    ("alg-complex-conj", _boxed("3 - 4i"), "3 + 4i", 0, "conjugate"),
    ("alg-log", _boxed(r"\log_2 8"), "3", 1, "evaluates to 3"),
    ("alg-binom", _boxed(r"\binom{5}{2}"), "10", 1, "evaluates to 10"),
    ("alg-pi-forms", _boxed(r"\frac{3}{4}\pi"), r"\frac{3\pi}{4}", 1, "same value"),
    (
        "alg-matrix",
        _boxed(r"\begin{pmatrix} 1 \\ 2 \end{pmatrix}"),
        r"\begin{pmatrix}1\\2\end{pmatrix}",
        1,
        "same vector",
    ),
    (
        "alg-matrix-wrong",
        _boxed(r"\begin{pmatrix} 1 \\ 3 \end{pmatrix}"),
        r"\begin{pmatrix}1\\2\end{pmatrix}",
        0,
        "different vector",
    ),
    ("alg-infinity", _boxed(r"\infty"), r"\infty", 1, "same"),
    ("alg-neg-infinity", _boxed(r"-\infty"), r"\infty", 0, "opposite sign"),
]

# Pairs the verifier gets wrong today. They are not in `corpus()` (whose labels the test
# asserts); the test checks they still fail, so that a fix gets noticed and they move over.
KNOWN_FALSE_NEGATIVES = [
    Case("fn-euler", _boxed(r"e^{i\pi}"), "-1", 1.0, "complex exponential not evaluated"),
    Case("fn-spaced-thousands", _boxed("1 000"), "1000", 1.0, "a plain space separator"),
]


# -- generated bulk --------------------------------------------------------------------------------

_LEADS = [
    "Let me work through this step by step. First we compute {a} and then {b}.",
    "We have {a} items, and after the change {b} remain, so we combine them.",
    "Step 1: {a}. Step 2: {b}. Combining the two steps gives the result.",
    "Set up the equation with {a} and {b}, then solve it.",
]


def _completion(rng: random.Random, answer: str, distractors: tuple[int, int]) -> str:
    """A completion stating `answer` in one of the supported formats, with distractor numbers."""
    lead = rng.choice(_LEADS).format(a=distractors[0], b=distractors[1])
    style = rng.randrange(6)
    if style == 0:
        return f"{lead}\n\nTherefore the answer is $\\boxed{{{answer}}}$."
    if style == 1:
        return f"{lead}\n\n\\[\\boxed{{{answer}}}\\]"
    if style == 2:
        return f"{lead}\n\nAnswer: ${answer}$"
    if style == 3:
        return f"<think>{lead} Hmm, maybe \\boxed{{{distractors[0]}}}.</think>\n\\boxed{{{answer}}}"
    if style == 4:
        return f"{lead}\n\n**Final Answer:** $\\boxed{{{answer}}}$"
    return f"{lead}\n\nThe final answer is ${answer}$."


def _with_thousands(n: int) -> str:
    return f"{n:,}"


def _gen_integers(rng, n):
    cases = []
    for k in range(n):
        v = rng.choice([rng.randint(1, 99), rng.randint(100, 9999), rng.randint(10000, 999999)])
        if rng.random() < 0.15:
            v = -v
        gold = rng.choice([str(v), f"The result follows.\n#### {v}", _with_thousands(v)])
        kind = rng.randrange(6)
        if kind == 0:
            answer, expected, note = str(v), 1, "same integer"
        elif kind == 1:
            answer, expected, note = _with_thousands(v), 1, "thousands separators"
        elif kind == 2:
            answer, expected, note = rf"\${v}", 1, "currency sign"
        elif kind == 3:
            answer, expected, note = str(v + rng.choice([-2, -1, 1, 10])), 0, "off by a little"
        elif kind == 4:
            answer, expected, note = str(-v), 0, "sign flipped"
        else:
            answer, expected, note = rf"\text{{{v}}}", 1, r"\text{} wrapper"
        if expected and "," in gold and "," not in answer:
            note += "; gold with thousands separators"
        d = (abs(v) + rng.randint(1, 50), rng.randint(2, 90))
        cases.append(Case(f"gen-int-{k:03d}", _completion(rng, answer, d), gold, expected, note))
    return cases


def _decimal_of(f: Fraction) -> str | None:
    """The exact decimal form of `f` if it terminates within 4 places."""
    for places in range(1, 5):
        scaled = f * 10**places
        if scaled.denominator == 1:
            return f"{float(f):.{places}f}"
    return None


def _frac_tex(f: Fraction) -> str:
    sign = "-" if f < 0 else ""
    return rf"{sign}\frac{{{abs(f.numerator)}}}{{{f.denominator}}}"


def _gen_fractions(rng, n):
    cases = []
    for k in range(n):
        q = rng.choice([2, 3, 4, 5, 6, 7, 8, 9, 10, 12, 16, 20, 25])
        p = rng.randint(1, 3 * q)
        while gcd(p, q) != 1:
            p += 1
        f = Fraction(p, q)
        if f.denominator == 1:
            f = Fraction(p, q + 1) if gcd(p, q + 1) == 1 else Fraction(1, q + 1)
        gold = _frac_tex(f)
        kind = rng.randrange(7)
        if kind == 0:
            answer, expected, note = gold, 1, "same fraction"
        elif kind == 1:
            m = rng.randint(2, 5)
            answer = rf"\frac{{{f.numerator * m}}}{{{f.denominator * m}}}"
            expected, note = 1, "unreduced fraction (decision: value counts)"
        elif kind == 2:
            answer = _decimal_of(f) or gold.replace(r"\frac", r"\dfrac")
            expected, note = 1, "decimal form" if _decimal_of(f) else r"\dfrac"
        elif kind == 3:
            answer, expected, note = f"{f.numerator}/{f.denominator}", 1, "slash form"
        elif kind == 4:
            answer, expected, note = _frac_tex(f + Fraction(1, f.denominator)), 0, "wrong value"
        elif kind == 5:
            answer, expected, note = _frac_tex(1 / f), 0, "reciprocal"
        else:
            answer, expected, note = _frac_tex(-f), 0, "sign flipped"
        cases.append(
            Case(f"gen-frac-{k:03d}", _completion(rng, answer, (p, q)), gold, expected, note)
        )
    return cases


_SQUAREFREE = [2, 3, 5, 6, 7, 10, 11, 13, 14, 15]


def _gen_radicals(rng, n):
    cases = []
    for k in range(n):
        a, b = rng.randint(2, 9), rng.choice(_SQUAREFREE)
        gold = rf"{a}\sqrt{{{b}}}"
        kind = rng.randrange(4)
        if kind == 0:
            answer, expected, note = gold, 1, "same form"
        elif kind == 1:
            answer, expected, note = rf"\sqrt{{{a * a * b}}}", 1, "unsimplified radical"
        elif kind == 2:
            answer, expected, note = rf"{a + 1}\sqrt{{{b}}}", 0, "wrong coefficient"
        else:
            answer, expected, note = rf"{a}\sqrt{{{b + 1}}}", 0, "wrong radicand"
        cases.append(
            Case(f"gen-sqrt-{k:03d}", _completion(rng, answer, (a, b)), gold, expected, note)
        )
    return cases


def _gen_pi(rng, n):
    cases = []
    for k in range(n):
        q = rng.choice([2, 3, 4, 6, 8, 12])
        p = rng.choice([x for x in range(1, 2 * q) if gcd(x, q) == 1])
        gold = rf"\frac{{{p if p > 1 else ''}\pi}}{{{q}}}"
        kind = rng.randrange(3)
        if kind == 0:
            answer, expected, note = gold, 1, "same form"
        elif kind == 1:
            answer, expected, note = rf"\frac{{{p}}}{{{q}}}\pi", 1, "coefficient written apart"
        else:
            answer, expected, note = rf"\frac{{{p}\pi}}{{{q + 1}}}", 0, "wrong denominator"
        cases.append(
            Case(f"gen-pi-{k:03d}", _completion(rng, answer, (p, q)), gold, expected, note)
        )
    return cases


def _gen_intervals(rng, n):
    cases = []
    for k in range(n):
        a = rng.randint(-9, 5)
        b = a + rng.randint(1, 9)
        left, right = rng.choice("(["), rng.choice(")]")
        gold = f"{left}{a}, {b}{right}"
        kind = rng.randrange(4)
        if kind == 0:
            answer, expected, note = f"{left}{a},{b}{right}", 1, "same interval"
        elif kind == 1:
            answer = rf"\left{left}{a}, {b}\right{right}"
            expected, note = 1, r"\left \right"
        elif kind == 2:
            flipped = "[" if left == "(" else "("
            answer, expected, note = f"{flipped}{a}, {b}{right}", 0, "left bracket differs"
        else:
            answer, expected, note = f"{left}{a}, {b + 1}{right}", 0, "wrong endpoint"
        d = (a, b)
        cases.append(
            Case(f"gen-interval-{k:03d}", _completion(rng, answer, d), gold, expected, note)
        )
    return cases


def _gen_pairs(rng, n):
    cases = []
    for k in range(n):
        a, b = rng.randint(-9, 9), rng.randint(-9, 9)
        while b == a:
            b = rng.randint(-9, 9)
        gold = f"({a}, {b})"
        kind = rng.randrange(3)
        if kind == 0:
            answer, expected, note = f"({a},{b})", 1, "same pair"
        elif kind == 1:
            answer, expected, note = f"({b}, {a})", 0, "swapped"
        else:
            answer, expected, note = f"({a}, {b + 1})", 0, "wrong coordinate"
        cases.append(
            Case(f"gen-pair-{k:03d}", _completion(rng, answer, (a, b)), gold, expected, note)
        )
    return cases


def _poly(b: int, c: int) -> str:
    s = "x^2"
    if b:
        s += f" {'+' if b > 0 else '-'} {abs(b)}x" if abs(b) != 1 else f" {'+' if b > 0 else '-'} x"
    if c:
        s += f" {'+' if c > 0 else '-'} {abs(c)}"
    return s


def _linear(r: int) -> str:
    return f"(x {'-' if r > 0 else '+'} {abs(r)})" if r else "x"


def _gen_polynomials(rng, n):
    cases = []
    for k in range(n):
        r, s = rng.randint(-6, 6), rng.randint(-6, 6)
        expanded = _poly(-(r + s), r * s)
        factored = f"{_linear(r)}{_linear(s)}"
        gold = rng.choice([expanded, factored])
        kind = rng.randrange(3)
        if kind == 0:
            answer = factored if gold == expanded else expanded
            expected, note = 1, "expanded vs factored"
        elif kind == 1:
            answer, expected, note = gold, 1, "same form"
        else:
            answer, expected, note = _poly(-(r + s), r * s + 1), 0, "wrong constant term"
        cases.append(
            Case(f"gen-poly-{k:03d}", _completion(rng, answer, (r, s)), gold, expected, note)
        )
    return cases


def _gen_decimals(rng, n):
    cases = []
    for k in range(n):
        v = Fraction(rng.randint(1, 9999), 100)
        gold = f"{float(v):.2f}"
        kind = rng.randrange(4)
        if kind == 0:
            answer, expected, note = gold, 1, "same decimal"
        elif kind == 1:
            answer, expected, note = f"{float(v):.3f}", 1, "trailing zero"
        elif kind == 2:
            answer, expected, note = _frac_tex(v) if v.denominator > 1 else gold, 1, "as a fraction"
            if v.denominator == 1:
                note = "same decimal"
        else:
            answer, expected, note = f"{float(v) + 0.01:.2f}", 0, "off by 0.01"
        d = (v.numerator, v.denominator)
        cases.append(
            Case(f"gen-decimal-{k:03d}", _completion(rng, answer, d), gold, expected, note)
        )
    return cases


def generated_cases(seed: int = 0) -> list[Case]:
    """Ordinary GSM8K/MATH-style pairs, labelled by construction."""
    rng = random.Random(seed)
    cases = (
        _gen_integers(rng, 90)
        + _gen_fractions(rng, 60)
        + _gen_radicals(rng, 25)
        + _gen_pi(rng, 15)
        + _gen_intervals(rng, 25)
        + _gen_pairs(rng, 15)
        + _gen_polynomials(rng, 25)
        + _gen_decimals(rng, 25)
    )
    return [dataclasses.replace(c, expected=float(c.expected), trap=False) for c in cases]


def trap_cases() -> list[Case]:
    return [Case(id_, c, g, float(e), note) for id_, c, g, e, note in _TRAPS]


def corpus() -> list[Case]:
    cases = trap_cases() + generated_cases()
    ids = [c.id for c in cases]
    assert len(ids) == len(set(ids)), "duplicate case ids"
    return cases


# -- the independent check: Hendrycks-MATH-style normalized string match ------------------------


def reference_extract(completion: str) -> str | None:
    """Final answer the MATH-paper way: the last box, else the text after the last 'answer'."""
    if "</think>" in completion:
        completion = completion.split("</think>")[-1]
    elif "<think>" in completion:
        return None
    start = max(completion.rfind("\\boxed"), completion.rfind("\\fbox"))
    if start >= 0:
        if completion.startswith("\\boxed ", start):
            return completion[start + len("\\boxed ") :].split("$")[0]
        open_at = completion.find("{", start)
        if open_at < 0:
            return None
        depth = 0
        for end in range(open_at, len(completion)):
            depth += {"{": 1, "}": -1}.get(completion[end], 0)
            if depth == 0:
                return completion[open_at + 1 : end]
        return None
    lower = completion.lower()
    cut = max(lower.rfind("answer is"), lower.rfind("answer:"))
    if cut < 0:
        return None
    rest = completion[cut:].split(":", 1)[-1] if lower.startswith("answer:", cut) else None
    if rest is None:
        rest = completion[cut + len("answer is") :]
    rest = rest.strip().split("\n")[0] or rest.strip().split("\n")[-1]
    rest = rest.replace("**", "").strip()
    math = re.match(r"\$((?:\\\$|[^$])*)\$", rest)
    if math:
        rest = math.group(1)
    return rest.rstrip(".").strip()


def _fix_fracs(s: str) -> str:
    r"""`\frac12` -> `\frac{1}{2}`, `\frac1{2}` -> `\frac{1}{2}`."""
    parts = s.split("\\frac")
    out = parts[0]
    for part in parts[1:]:
        out += "\\frac"
        if part.startswith("{") or len(part) < 2:
            out += part
            continue
        numerator, tail = part[0], part[1:]
        if tail.startswith("{"):
            out += "{" + numerator + "}" + tail
        else:
            out += "{" + numerator + "}{" + tail[0] + "}" + tail[1:]
    return out


def _fix_slash(s: str) -> str:
    m = re.fullmatch(r"(-?\d+)/(\d+)", s)
    return rf"\frac{{{m.group(1)}}}{{{m.group(2)}}}" if m else s


def _fix_sqrt(s: str) -> str:
    return re.sub(r"\\sqrt(\w)", r"\\sqrt{\1}", s)


def strip_string(s: str) -> str:
    """Normalization in the spirit of the MATH paper's `strip_string`."""
    s = s.replace("\n", "").replace("\\!", "")
    s = s.replace("\\\\", "\\")
    s = s.replace("tfrac", "frac").replace("dfrac", "frac")
    s = s.replace("\\left", "").replace("\\right", "")
    s = s.replace("^{\\circ}", "").replace("^\\circ", "")
    s = s.replace("\\$", "")
    if "\\text{ " in s:  # Units: "5\text{ cm}" -> "5".
        s = s.split("\\text{ ")[0]
    s = s.replace("\\%", "").replace("%", "")
    s = s.replace(" .", " 0.").replace("{.", "{0.")
    if s.startswith("."):
        s = "0" + s
    sides = s.split("=")
    if len(sides) == 2 and len(sides[0].strip()) <= 2:
        s = sides[1]
    s = _fix_sqrt(s)
    s = s.replace(" ", "")
    s = _fix_fracs(s)
    if s == "0.5":
        s = "\\frac{1}{2}"
    return _fix_slash(s)


def string_match(completion: str, gold: str) -> float:
    """1.0 if the normalized final answer equals the normalized gold answer, else 0.0."""
    answer = reference_extract(completion)
    if answer is None:
        return 0.0
    if "\\boxed" in gold or "\\fbox" in gold:
        gold = reference_extract(gold) or ""
    elif "####" in gold:
        gold = gold.split("####")[-1]
    gold = gold.strip().strip("$")
    return float(strip_string(answer) == strip_string(gold))


# -- the audit ----------------------------------------------------------------------------------


# The README's table of disagreements sits between these lines; the test reads the ids there.
DISAGREEMENTS_START = "<!-- disagreements:start -->"
DISAGREEMENTS_END = "<!-- disagreements:end -->"


@dataclasses.dataclass(frozen=True)
class AuditRow:
    case: Case
    verifier: float
    string_match: float


def audit(scores: list[float], cases: list[Case]) -> list[AuditRow]:
    """Pairs each case with the verifier's score (given) and the string match's."""
    return [AuditRow(c, s, string_match(c.completion, c.gold)) for c, s in zip(cases, scores)]


def _cell(s: str, width: int = 60) -> str:
    s = " ".join(s.split())
    if len(s) > width:
        s = s[: width - 3] + "..."
    return "`" + s.replace("|", "\\|").replace("`", "'") + "`" if s else "(none)"


def plain_math_verify(completion: str, gold: str) -> bool:
    """math-verify alone, as its README uses it: default extraction over the whole completion,
    no numeric guard (run it in a fresh process: `check_answer` installs the guard)."""
    import math_verify

    from rlscale.rewards import math as math_reward

    gold_parsed = math_verify.parse(f"${math_reward.extract_gold(gold)}$", parsing_timeout=None)
    pred_parsed = math_verify.parse(completion, parsing_timeout=None)
    return bool(math_verify.verify(gold_parsed, pred_parsed, timeout_seconds=None))


def baseline_report(cases: list[Case], plain: list[float]) -> str:
    """Markdown: where math-verify alone differs from the hand label."""
    wrong = [(c, p) for c, p in zip(cases, plain) if p != c.expected]
    lines = [
        f"math-verify alone equals the hand label on {len(cases) - len(wrong)}/{len(cases)} "
        "pairs. The ones it gets wrong:",
        "",
        "| id | gold | label | math-verify alone | why |",
        "| --- | --- | --- | --- | --- |",
    ]
    for c, p in wrong:
        lines.append(
            f"| {c.id} | {_cell(c.gold)} | {int(c.expected)} | {int(p)} | {_note(c.note)} |"
        )
    return "\n".join(lines)


def _note(s: str) -> str:
    return s.replace("<", "&lt;")  # `</think>` would be read as an HTML tag.


def report(rows: list[AuditRow]) -> str:
    """Markdown: the counts, the disagreements by reason, and one table row per disagreement."""
    from rlscale.rewards import math as math_reward

    n = len(rows)
    traps = sum(r.case.trap for r in rows)
    verifier_ok = sum(r.verifier == r.case.expected for r in rows)
    string_ok = sum(r.string_match == r.case.expected for r in rows)
    disagree = [r for r in rows if r.verifier != r.string_match]
    agree = n - len(disagree)
    lines = [
        f"- pairs: {n} ({traps} hand-written traps, {n - traps} generated)",
        f"- verifier equals the hand label: {verifier_ok}/{n}",
        f"- string match equals the hand label: {string_ok}/{n}",
        f"- verifier and string match agree: {agree}/{n} ({100 * agree / n:.1f}%)",
        f"- disagreements: {len(disagree)} ({sum(r.case.trap for r in disagree)} traps, "
        f"{sum(not r.case.trap for r in disagree)} generated)",
        "",
        "Generated disagreements by reason:",
        "",
        "| reason | count | right | string match says |",
        "| --- | --- | --- | --- |",
    ]
    groups: dict[tuple[str, str, int], int] = {}
    for r in disagree:
        if not r.case.trap:
            right = "verifier" if r.verifier == r.case.expected else "string match"
            key = (r.case.note, right, int(r.string_match))
            groups[key] = groups.get(key, 0) + 1
    for (note, right, said), count in sorted(groups.items(), key=lambda kv: -kv[1]):
        lines.append(f"| {_note(note)} | {count} | {right} | {said} |")
    lines += [
        "",
        "Every disagreement (answer: as the verifier extracts it; `a` / `b` when the string "
        "match extracts `b`):",
        "",
        DISAGREEMENTS_START,
        "",
        "| id | answer | gold | label | verifier | string match | right | why |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in disagree:
        right = "verifier" if r.verifier == r.case.expected else "string match"
        ours = math_reward.extract_answer(r.case.completion)
        theirs = reference_extract(r.case.completion)
        answer = _cell(ours or "")
        if (ours or "") != (theirs or "").strip():
            answer += " / " + _cell(theirs or "")
        lines.append(
            f"| {r.case.id} | {answer} | {_cell(r.case.gold)} | {int(r.case.expected)} "
            f"| {int(r.verifier)} | {int(r.string_match)} | {right} | {_note(r.case.note)} |"
        )
    lines += ["", DISAGREEMENTS_END]
    return "\n".join(lines)


def main():
    from rlscale.rewards import math as math_reward

    cases = corpus()
    with math_reward.MathVerifier(timeout=3.0) as verifier:
        scores = verifier.verify_batch([c.completion for c in cases], [c.gold for c in cases])
        stats = verifier.stats()
    print(report(audit(scores, cases)))
    print(f"\nverifier stats: {stats}\n")

    from rlscale.rewards import sandbox

    # 'spawn': fresh interpreters, so math-verify runs unpatched.
    with sandbox.WorkerPool(plain_math_verify, 2, start_method="spawn") as pool:
        results = pool.map([(c.completion, c.gold) for c in cases], timeout=3.0)
    plain = [float(r.status == sandbox.OK and r.value) for r in results]
    print(baseline_report(cases, plain))


if __name__ == "__main__":
    main()
