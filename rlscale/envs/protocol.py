"""The environment protocol: what a user implements to put a multi-turn environment (a tool, a
game, a grader that answers back) in the RL loop.

An episode is one sample of one prompt. The policy writes until it ends a turn with one of the
environment's `stops` (for example the end of a code block); the environment reads that turn's
text and replies; the reply's tokens join the sample's context (out of the loss) and the policy
writes its next turn. The episode ends when the policy ends its sample (end of sequence), when
the environment says so (`Reply.done`), or at a limit (`EnvConfig`).

The interface is text in, text out, per turn, as verl's agent loops, Tunix's `BaseEnv` and
OpenEnv's environments read and write text: a user's environment needs no tokenizer. The
token ids stay exactly as sampled all the same: only the reply is tokenized (appended to the
cache after the policy's own tokens), never the history, so no re-tokenization can move what
the learner trains on away from what the sampler sampled.

A single-turn task is the one-step case: an environment with no `stops` is never stepped, and
the task's verifier scores the completion (`SingleTurn`).
"""

import abc
import dataclasses
from collections.abc import Mapping


@dataclasses.dataclass(frozen=True)
class Reply:
    """The environment's answer to one turn.

    Attributes:
      text: appended to the episode after the policy's turn (tokenized without special
        tokens, cut to `env.reply_tokens`; out of the loss). Empty: nothing is appended, and
        the policy writes on.
      done: the episode ends here: the policy writes no further turn (and `text` is not
        appended).
      reward: the episode's reward, given when `done`; None leaves it to the task's verifier,
        which reads the policy's text of the whole episode (the environment's replies left
        out, so an answer only counts where the policy stated it).
      info: counters summed over the episode's turns into the step's metrics
        (`env/<key>`), for example `tool_calls`, `tool_errors`, `tool_timeouts`.
    """

    text: str = ""
    done: bool = False
    reward: float | None = None
    info: Mapping[str, float] = dataclasses.field(default_factory=dict)


class Environment(abc.ABC):
    """One episode's environment: made for one sample and reset once with its problem, then
    stepped once per turn, one turn at a time, all from worker threads (never the decode
    thread; `envs.episodes.Episodes`).

    Class attributes:
      stops: the text strings that end a policy turn (each must encode to 1 to 8 tokens; the
        run checks at start-up that the tokenizer produces them). Empty: single-turn. Read
        from an instance, so a constructor may set them from its arguments.
    """

    stops: tuple[str, ...] = ()

    @abc.abstractmethod
    def reset(self, problem) -> None:
        """Starts an episode on `problem` (the task's `Problem`: prompt, answer, demo)."""

    @abc.abstractmethod
    def step(self, action: str) -> Reply:
        """The reply to the policy's turn `action`: its text since the previous reply, ending
        with one of `stops`. May block (a tool call); the run bounds it
        (`env.call_seconds`). An exception ends the episode with reward 0 and is counted
        (`env/ended_error`): it costs that sample, never the run."""


class SingleTurn(Environment):
    """Today's tasks: no stops, never stepped; the task's verifier scores the completion."""

    def reset(self, problem) -> None:
        del problem

    def step(self, action: str) -> Reply:
        raise AssertionError("a single-turn episode has no turns to step")
