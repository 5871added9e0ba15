"""Synthetic, verifiable tasks (arithmetic, countdown) generated deterministically from (task,
difficulty, seed, split, index), with disjoint splits and grammar-based verifiers that grade only a
stated `Answer: N`. See docs/data.md.
"""

import dataclasses
import hashlib
import re
from collections.abc import Iterator

import numpy as np

ANSWER_RE = re.compile(r"Answer:\s*(-?\d+)\s*$")
SPLITS = ("train", "test")


@dataclasses.dataclass(frozen=True)
class Problem:
    prompt: str
    answer: str
    demo: str  # A correct completion (without the end-of-sequence token).


def _split_of(prompt: str, test_fraction: float) -> str:
    h = int.from_bytes(hashlib.sha256(prompt.encode()).digest()[:8], "little")
    return "test" if h / 2**64 < test_fraction else "train"


# ------------------------------------------------------------------------------------------
# A tiny expression grammar (numbers, + - *, left to right with * first): parsing, not eval.
# ------------------------------------------------------------------------------------------

_TOKEN_RE = re.compile(r"\s*(\d+|[+\-*])")


def parse_expression(text: str) -> tuple[list[int], list[str]] | None:
    """Splits "3*5+7" into ([3, 5, 7], ["*", "+"]); None if it is not such an expression."""
    text = text.strip()
    pos, numbers, ops = 0, [], []
    expect_number = True
    while pos < len(text):
        m = _TOKEN_RE.match(text, pos)
        if not m:
            return None
        tok = m.group(1)
        if expect_number != tok.isdigit() or (tok.isdigit() and len(tok) > 6):
            return None
        (numbers if expect_number else ops).append(int(tok) if expect_number else tok)
        expect_number = not expect_number
        pos = m.end()
    if expect_number or not numbers:
        return None
    return numbers, ops


def fold_products(numbers: list[int], ops: list[str]) -> tuple[list[int], list[str]]:
    """Multiplies out the products: 3-5*6 -> ([3, 30], ["-"])."""
    terms, signs = [numbers[0]], []
    for op, n in zip(ops, numbers[1:]):
        if op == "*":
            terms[-1] *= n
        else:
            terms.append(n)
            signs.append(op)
    return terms, signs


def evaluate(numbers: list[int], ops: list[str]) -> int:
    """Value with the usual precedence (* before + and -)."""
    terms, signs = fold_products(numbers, ops)
    value = terms[0]
    for sign, t in zip(signs, terms[1:]):
        value = value + t if sign == "+" else value - t
    return value


def final_answer(completion: str) -> str | None:
    """The integer after the last "Answer:" at the end of the completion, else None."""
    m = ANSWER_RE.search(completion.strip())
    return m.group(1) if m else None


def without_answer_line(problem: Problem) -> str:
    """The demonstration's working without its final "Answer: N" line."""
    return problem.demo.rsplit("Answer:", 1)[0].strip()


class Task:
    """Base class: `problem(split, index)`, `problems(split, n)` and `verify`."""

    name: str

    def __init__(self, difficulty: int, seed: int = 0, test_fraction: float = 0.2):
        self.difficulty = difficulty
        self.seed = seed
        self.test_fraction = test_fraction

    def _sample(self, rng: np.random.Generator) -> Problem:
        raise NotImplementedError

    def problems(self, split: str, n: int) -> Iterator[Problem]:
        """The first n problems of a split, in a fixed order."""
        if split not in SPLITS:
            raise ValueError(f"split {split!r} is not one of {SPLITS}")
        seen, i, misses = set(), 0, 0
        while len(seen) < n:
            rng = np.random.default_rng([self.seed, self.difficulty, i])
            i += 1
            p = self._sample(rng)
            if p.prompt in seen or _split_of(p.prompt, self.test_fraction) != split:
                misses += 1
                if misses > 20_000:  # The problem space is (nearly) exhausted.
                    raise ValueError(
                        f"{self.name} difficulty {self.difficulty} has fewer "
                        f"than {n} distinct {split} problems (found {len(seen)})"
                    )
                continue
            misses = 0
            seen.add(p.prompt)
            yield p

    def verify(self, completion: str, problem: Problem) -> float:
        raise NotImplementedError


class Arithmetic(Task):
    """Multi-step integer arithmetic; the demonstration reduces products first, then sums."""

    name = "arithmetic"

    def _sample(self, rng):
        k = self.difficulty
        numbers = [int(x) for x in rng.integers(1, 10, k + 1)]
        ops = [str(o) for o in rng.choice(["+", "-", "*"], k)]
        expr = "".join(f"{n}{o}" for n, o in zip(numbers, ops)) + str(numbers[-1])
        value = evaluate(numbers, ops)
        # Worked steps: one operation per step, products first, then left to right.
        steps = []
        while ops:
            i = ops.index("*") if "*" in ops else 0
            a, b = numbers[i], numbers[i + 1]
            r = a * b if ops[i] == "*" else a + b if ops[i] == "+" else a - b
            numbers = numbers[:i] + [r] + numbers[i + 2 :]
            ops = ops[:i] + ops[i + 1 :]
            steps.append("".join(f"{n}{o}" for n, o in zip(numbers, ops)) + str(numbers[-1]))
        demo = "=".join(steps) + f" Answer: {value}"
        return Problem(prompt=f"Q: {expr}=", answer=str(value), demo=demo)

    def verify(self, completion, problem):
        return float(final_answer(completion) == problem.answer)


class Countdown(Task):
    """Combine the given numbers (each at most once) with + - * to reach the target."""

    name = "countdown"

    def _sample(self, rng):
        k = self.difficulty
        numbers = [int(x) for x in rng.integers(1, 10, k)]
        ops = [str(o) for o in rng.choice(["+", "-", "*"], k - 1)]
        target = evaluate(numbers, ops)
        shown = sorted(numbers)
        expr = "".join(f"{n}{o}" for n, o in zip(numbers, ops)) + str(numbers[-1])
        prompt = f"Q: reach {target} with {' '.join(map(str, shown))}="
        return Problem(prompt=prompt, answer=str(target), demo=f"{expr} Answer: {target}")

    def verify(self, completion, problem):
        text = completion.strip()
        if final_answer(text) != problem.answer:
            return 0.0
        head = text.split("Answer:")[0]
        parsed = parse_expression(head)
        if parsed is None:
            return 0.0
        numbers, ops = parsed
        available = [int(x) for x in problem.prompt.split(" with ")[1].rstrip("=").split()]
        for n in numbers:
            if n not in available:
                return 0.0
            available.remove(n)
        return float(evaluate(numbers, ops) == int(problem.answer))


TASKS = {"arithmetic": Arithmetic, "countdown": Countdown}


def get(name: str, difficulty: int, seed: int = 0) -> Task:
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; tasks: {', '.join(TASKS)}")
    if difficulty < 1:
        raise ValueError(f"task difficulty={difficulty} must be >= 1")
    return TASKS[name](difficulty, seed)
