"""Synthetic, verifiable tasks (arithmetic, countdown, tool_arithmetic, guess_number) generated
deterministically from (task, difficulty, seed, split, index), with disjoint splits and
grammar-based verifiers that grade only a stated `Answer: N` (guess_number: a guess). The tasks
played with an environment write their demonstrations in the environment's own text formats
(`rlscale.envs.python_tool`, `rlscale.envs.guess`). See docs/data.md.
"""

import dataclasses
import hashlib
import re
from collections.abc import Iterator

import numpy as np

from rlscale.envs import guess, python_tool

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


def demo_turns(task: "Task", demo: str) -> list[tuple[str, bool]]:
    """A demonstration as its episode plays it: (text, whether the environment wrote it), in
    order. A task whose demonstrations were played against an environment (`demo_stop`: its
    turns end there, and each reply is the one line after) alternates the policy's turns and
    the replies; any other demonstration is one turn of the policy."""
    stop, turns, rest = task.demo_stop, [], demo
    while stop and stop in rest:
        action, _, rest = rest.partition(stop)
        reply, newline, rest = rest.partition("\n")
        turns += [(action + stop, False), (reply + newline, True)]
    return turns + [(rest, False)] if rest else turns


def without_answer_line(problem: Problem) -> str:
    """The demonstration's working without its final "Answer: N" line."""
    return problem.demo.rsplit("Answer:", 1)[0].strip()


class Task:
    """Base class: `problem(split, index)`, `problems(split, n)` and `verify`."""

    name: str
    max_difficulty: int | None = None  # None: any difficulty >= 1.
    demo_stop: str | None = None  # Demonstrations played against an environment: `demo_turns`.

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

    def _count(self, rng: np.random.Generator) -> int:
        """The problem's number of operators."""
        return self.difficulty

    def _draw(self, rng: np.random.Generator) -> tuple[list[int], list[str]]:
        """The problem's numbers (1 to 9) and operators."""
        k = self._count(rng)
        numbers = [int(x) for x in rng.integers(1, 10, k + 1)]
        return numbers, [str(o) for o in rng.choice(["+", "-", "*"], k)]

    def _sample(self, rng):
        numbers, ops = self._draw(rng)
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


class LongArithmetic(Arithmetic):
    """Arithmetic whose problems take `difficulty` to 2 x `difficulty` operators, drawn per
    problem, and no product of more than two numbers (a `*` after a `*` is redrawn as `+` or
    `-`): long worked completions of unequal lengths (difficulty 7: 59 to 264 tokens), made
    of many easy steps (a times-table product, or a sum of numbers under a thousand), each a
    place to go wrong. The testbed for long completions (`config_lib.long_testbed`): a
    generation budget below the longest demonstrations truncates some, and prompt-mean
    aggregation weighs completions of unequal lengths. (With chained products, 243*2 and the
    like, a 1.8M-parameter warm start solved 3% of difficulty 6.)"""

    name = "long_arithmetic"

    def _count(self, rng):
        return int(rng.integers(self.difficulty, 2 * self.difficulty + 1))

    def _draw(self, rng):
        numbers, ops = super()._draw(rng)
        for i in range(1, len(ops)):
            if ops[i] == ops[i - 1] == "*":
                ops[i] = str(rng.choice(["+", "-"]))
        return numbers, ops


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


class ToolArithmetic(Task):
    """`a*b+c` or `a*b-c` over numbers of 4 + difficulty digits (difficulty 1 to 5: 5 to 9
    digits), which a small policy cannot multiply in its head but can by calling the Python
    tool (`envs.python_tool.PythonTool`). Graded like arithmetic: the stated `Answer: N`.

    A `tool_fraction` of the demonstrations (drawn per problem, after its numbers, so the
    problems do not depend on it) call the tool: the code block, the tool's reply exactly as
    the environment writes it, then `Answer: N`:

        ```python\\n48213*99201+55123\\n```\\noutput: 4782832936\\nAnswer: 4782832936

    The rest answer directly, with the correct answer (`Answer: 4782832936`). So every
    demonstration states a right answer, and the warm start is diffuse rather than
    confidently wrong: it cannot learn the digits of a direct answer, so its direct answers
    spread over many numbers (right about as rarely as guesses), while it calls the tool on
    about a `tool_fraction` of problems and copies the tool's output into the answer. RL then
    separates the two behaviours it already has, and moves mass to the tool. A demonstration
    that stated an estimate instead (the leading digits, or a rounded value) would teach the
    policy a wrong answer that it can learn exactly, and that RL must unlearn.

    The warm start keeps the answer line in only `sft.answer_line_fraction` of its
    demonstrations, and one without it is empty when direct: train this task's warm start
    with `sft.answer_line_fraction=1`.
    """

    name = "tool_arithmetic"
    max_difficulty = 5
    demo_stop = python_tool.STOP

    def __init__(self, difficulty, seed=0, test_fraction=0.2, tool_fraction: float = 0.3):
        super().__init__(difficulty, seed, test_fraction)
        if not 0.0 <= tool_fraction <= 1.0:
            raise ValueError(f"tool_fraction={tool_fraction!r} must be in [0, 1]")
        self.tool_fraction = tool_fraction

    def _sample(self, rng):
        digits = 4 + self.difficulty
        a, b, c = (int(x) for x in rng.integers(10 ** (digits - 1), 10**digits, 3))
        op = str(rng.choice(["+", "-"]))
        expr = f"{a}*{b}{op}{c}"
        value = a * b + c if op == "+" else a * b - c
        demo = f"Answer: {value}"
        if rng.random() < self.tool_fraction:
            reply = python_tool.output_reply(f"{value}\n", python_tool.MAX_REPLY_CHARS)
            demo = python_tool.tool_call(expr) + reply + demo
        return Problem(prompt=f"Q: {expr}=", answer=str(value), demo=demo)

    def verify(self, completion, problem):
        return float(final_answer(completion) == problem.answer)

    extract_answer = staticmethod(final_answer)  # For majority voting (`eval.harness`).


class NumberGuessing(Task):
    """Guess a secret number from 1 to 2**(difficulty + 2) within difficulty + 3 tries, told
    "higher" or "lower" after each wrong guess: played with `envs.guess.GuessNumber`, whose
    reward comes only at the end of a dialogue of several turns.

    A prompt names a game number drawn apart from the secret (`Q: game 04821: guess 1 to 16
    in 5 tries`), so that problems are distinct and the splits (which hash the prompt) are
    disjoint; the secret is the answer. A demonstration is a won game, played against the
    environment (its replies are the environment's own): each guess is the middle of the
    range the replies leave, or, with probability `jitter`, anywhere in that range, a game
    replayed until it wins within the tries (pure bisection, which always does, after 20
    replays). So the warm start searches, but not always by halves, and loses some games that
    RL can teach it to win. The verifier scores 1 when one of the first `tries` turns of the
    policy's text guesses the secret (`guess.turn_guesses`).
    """

    name = "guess_number"
    demo_stop = guess.STOP

    def __init__(self, difficulty, seed=0, test_fraction=0.2, jitter: float = 0.3):
        super().__init__(difficulty, seed, test_fraction)
        if not 0.0 <= jitter <= 1.0:
            raise ValueError(f"jitter={jitter!r} must be in [0, 1]")
        self.jitter = jitter

    def _sample(self, rng):
        rules = guess.Rules(low=1, high=2 ** (self.difficulty + 2), tries=self.difficulty + 3)
        game = int(rng.integers(0, 100_000))
        secret = int(rng.integers(rules.low, rules.high + 1))
        problem = Problem(f"Q: game {game:05d}: {guess.rules_text(rules)}\n", str(secret), "")
        return dataclasses.replace(problem, demo=self._won_game(problem, rules, rng))

    def _won_game(self, problem, rules, rng, replays=20):
        for replay in range(replays + 1):
            env = guess.GuessNumber()
            env.reset(problem)
            low, high, text = rules.low, rules.high, ""
            while True:
                middle = replay == replays or rng.random() >= self.jitter
                g = (low + high) // 2 if middle else int(rng.integers(low, high + 1))
                reply = env.step(guess.guess_line(g))
                text += guess.guess_line(g) + reply.text
                if reply.done:
                    break
                low, high = (g + 1, high) if reply.text == guess.HIGHER else (low, g - 1)
            if reply.reward == 1.0:
                return text
        raise AssertionError(f"bisection lost {problem}")  # Unreachable: it takes <= tries.

    def verify(self, completion, problem):
        tries = guess.rules_of(problem.prompt).tries
        return float(int(problem.answer) in guess.turn_guesses(completion)[:tries])


TASKS = {
    "arithmetic": Arithmetic,
    "long_arithmetic": LongArithmetic,
    "countdown": Countdown,
    "tool_arithmetic": ToolArithmetic,
    "guess_number": NumberGuessing,
}


def get(name: str, difficulty: int, seed: int = 0) -> Task:
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; tasks: {', '.join(TASKS)}")
    top = TASKS[name].max_difficulty
    if difficulty < 1 or (top is not None and difficulty > top):
        bounds = ">= 1" if top is None else f"in [1, {top}]"
        raise ValueError(f"task difficulty={difficulty} must be {bounds} for {name!r}")
    return TASKS[name](difficulty, seed)
