"""A multi-turn game with feedback between turns (`GuessNumber`): the policy guesses a secret
number, the environment answers "higher", "lower" or "correct", and the episode's reward comes
only at its end, so the learner must credit the turns that led to it. It owns the game's text
formats (the rules in the prompt, the guess line, the replies), which the `guess_number` task
(`data.tasks`) writes its problems and demonstrations with.

    prompt:  Q: game 04821: guess 1 to 16 in 5 tries\\n
    policy:  8?\\n             (a turn ends at `STOP`)
    reply:   higher\\n
    policy:  12?\\n
    reply:   lower\\n
    policy:  10?\\n
    reply:   correct\\n       (done, reward 1)

Token boundaries (docs/environments.md): a guess line ends with a digit, then the stop; a
reply begins with a letter after the stop's newline and ends with a newline before the next
guess's first digit. The task's SentencePiece tokenizer merges none of these pairs.
"""

import dataclasses
import re

from rlscale.envs.protocol import Environment, Reply

STOP = "?\n"
HIGHER, LOWER, CORRECT, INVALID = "higher\n", "lower\n", "correct\n", "say a number\n"

_RULES_RE = re.compile(r"guess (-?\d+) to (-?\d+) in (\d+) tries")
_GUESS_RE = re.compile(r"(-?\d+)\s*\?\s*$")


@dataclasses.dataclass(frozen=True)
class Rules:
    low: int  # The secret is in [low, high].
    high: int
    tries: int  # Guesses allowed; the episode ends with reward 0 after this many.


def rules_text(rules: Rules) -> str:
    """How a prompt states the rules (`rules_of` reads them back)."""
    return f"guess {rules.low} to {rules.high} in {rules.tries} tries"


def rules_of(prompt: str) -> Rules:
    """The rules a prompt states (`rules_text`).

    Raises:
      ValueError: the prompt states none.
    """
    m = _RULES_RE.search(prompt)
    if m is None:
        raise ValueError(f"prompt {prompt!r} states no rules ({rules_text(Rules(1, 8, 4))!r})")
    return Rules(*map(int, m.groups()))


def guess_line(guess: int) -> str:
    """The policy's text of one guess, up to and with the stop."""
    return f"{guess}{STOP}"


def guess_of(turn: str) -> int | None:
    """The number a turn guesses (the last number before its final "?"), or None."""
    m = _GUESS_RE.search(turn)
    return int(m.group(1)) if m else None


def turn_guesses(text: str) -> list[int | None]:
    """The guess of each turn of an episode's text (the policy's turns, with or without the
    replies between them): turns end at `STOP`, and a last turn cut short after its "?"
    counts too."""
    *turns, tail = text.split(STOP)
    guesses = [guess_of(turn + "?") for turn in turns]
    if tail.rstrip().endswith("?"):
        guesses.append(guess_of(tail))
    return guesses


class GuessNumber(Environment):
    """Guess the problem's secret (`problem.answer`) within the prompt's rules (`rules_of`).

    Each turn ending with `STOP` is one guess (a turn with no number is an invalid guess,
    which costs a try): the reply is `CORRECT` (done, reward 1), else `HIGHER` or `LOWER` (the
    secret is above or below the guess) or `INVALID`, done with reward 0 once the tries are
    spent. The reward depends on every guess: a search that ignores the replies runs out of
    tries. `info` counts `guesses` and `invalid_guesses`.
    """

    stops = (STOP,)

    def reset(self, problem) -> None:
        self.secret = int(problem.answer)
        self.rules = rules_of(problem.prompt)
        self.guesses = 0

    def step(self, action: str) -> Reply:
        guess = guess_of(action)
        self.guesses += 1
        info = {"guesses": 1, "invalid_guesses": int(guess is None)}
        if guess == self.secret:
            return Reply(CORRECT, done=True, reward=1.0, info=info)
        spent = self.guesses >= self.rules.tries
        text = INVALID if guess is None else HIGHER if self.secret > guess else LOWER
        return Reply(text, done=spent, reward=0.0 if spent else None, info=info)
