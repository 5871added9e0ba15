"""Environments for the reliability tests, importable by the runs they start
(`--config.env.name=env_fixtures:Calculator` with this directory on PYTHONPATH).

`Calculator` works on the arithmetic task's prompts ("Q: 5+7+8="): a policy turn ends at
"=" (the warm-started tiny policy writes one in most samples, "5+9=16"), and the reply is the
value of the expression the turn ends with ("14"), a few tokens. Every reply is a function of
the turn's text alone, so a run's episodes are as deterministic as its sampling.
"""

import re
import threading

from rlscale.envs.protocol import Environment, Reply

STOP = "="
FAULTS = ("raise", "hang", "garbage")
# Lets the calls that hang go (a test sets it when its run is over).
RELEASE = threading.Event()
# An expression the reply evaluates: small numbers joined by +, - or * (no "**": each
# operator sits between digits).
_EXPRESSION = re.compile(r"(\d{1,4}(?:[+*-]\d{1,4}){0,6})=$")


def value_of(action: str) -> str:
    """The reply to a turn: the value of the expression just before its final "=", or "?"."""
    m = _EXPRESSION.search(action)
    return str(eval(m.group(1))) if m else "?"  # Digits and +-* only (the pattern).


class Calculator(Environment):
    """Replies to each turn with `value_of` it (`info`: `tool_calls`).

    Args:
      faults: (prompt, fault, call) triples: the episodes of that prompt misbehave at their
        `call`-th call (1-based) and after: "raise" raises, "hang" blocks (until `RELEASE`
        or `hang_seconds`), "garbage" returns a string, not a `Reply`.
      hang_seconds: how long a call that hangs blocks at most.
    """

    stops = (STOP,)

    def __init__(self, faults=(), hang_seconds=60.0):
        self.faults = {str(prompt): (fault, int(call)) for prompt, fault, call in faults}
        unknown = {fault for fault, _ in self.faults.values()} - set(FAULTS)
        if unknown:
            raise ValueError(f"faults {sorted(unknown)} are not among {FAULTS}")
        self.hang_seconds = hang_seconds

    def reset(self, problem) -> None:
        self.prompt, self.calls = problem.prompt, 0

    def step(self, action: str) -> Reply:
        self.calls += 1
        fault, call = self.faults.get(self.prompt, (None, 0))
        if fault is not None and self.calls >= call:
            if fault == "raise":
                raise RuntimeError("the calculator broke")
            if fault == "hang":
                RELEASE.wait(self.hang_seconds)
            if fault == "garbage":
                return "14"  # Not a Reply.
        return Reply(value_of(action), info={"tool_calls": 1})
