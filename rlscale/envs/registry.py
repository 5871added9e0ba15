"""The environments a run can name, and its `config.env` section: `ENVIRONMENTS` (name ->
class), `EnvConfig` (which environment and the limits of its episodes), `make_factory` (the
named class, checked and built once at start-up) and `action_stops` (its stop strings as the
run's tokenizer writes them: the generator's `SamplingConfig.action_stops`).
"""

import dataclasses
import difflib
import importlib
import inspect
from collections.abc import Mapping
from typing import Any

import jax

from rlscale import sections
from rlscale.envs.guess import GuessNumber
from rlscale.envs.protocol import Environment, SingleTurn
from rlscale.envs.python_tool import PythonTool
from rlscale.sampling.sampler import MAX_ACTION_STOP

SINGLE_TURN = "single_turn"
# Name -> class; `env.name` names one, or a user's class as "module.path:ClassName".
ENVIRONMENTS: dict[str, type[Environment]] = {
    SINGLE_TURN: SingleTurn,
    "python_tool": PythonTool,
    "guess_number": GuessNumber,
}


@dataclasses.dataclass(frozen=True)
class EnvConfig(sections.Section):
    """`config.env` (docs/environments.md): the environment of every episode, `name` (a
    registered name, or "module.path:ClassName") built with `kwargs`, and the limits of an
    episode: `max_turns` policy turns, `reply_tokens` tokens per reply (a longer one is
    cut), `call_seconds` of wall-clock per `Environment.step` call and `episode_seconds` per
    episode; `workers` threads run the environments' calls; `parked` parking rows of the
    generator hold samples waiting on a call while a queued request takes their slot
    (`Generator(parked=...)`). An episode's tokens, the policy's and the replies' together,
    are `sampling.max_new_tokens`."""

    name: str = SINGLE_TURN
    kwargs: Any = dataclasses.field(default_factory=dict)
    max_turns: int = 4
    reply_tokens: int = 256
    call_seconds: float = 10.0
    episode_seconds: float = 300.0
    workers: int = 8
    parked: int = 0

    def problems(self) -> list[str]:
        problems = sections.at_least("env.max_turns", self.max_turns, 1)
        problems += sections.at_least("env.reply_tokens", self.reply_tokens, 1)
        problems += sections.at_least("env.workers", self.workers, 1)
        problems += sections.at_least("env.parked", self.parked, 0)
        if self.parked and self.name == SINGLE_TURN:
            problems.append(
                f"env.parked={self.parked} parks samples waiting on an environment's reply: "
                f"env.name={SINGLE_TURN!r} never replies"
            )
        for key in ("call_seconds", "episode_seconds"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                problems.append(f"env.{key}={v!r} must be a number of seconds > 0")
        if not isinstance(self.kwargs, Mapping):
            problems.append(f"env.kwargs={self.kwargs!r} must be a dict of keyword arguments")
        return problems + environment_class(self.name)[1]

    @property
    def single_turn(self) -> bool:
        return self.name == SINGLE_TURN


def environment_class(name) -> tuple[type[Environment] | None, list[str]]:
    """(The class `env.name` names, []) or (None, its problems): a registered name, or
    "module.path:ClassName" of a concrete `Environment` subclass."""
    key = f"env.name={name!r}"
    if not isinstance(name, str) or not name:
        return None, [
            f"{key} must be a registered name ({', '.join(ENVIRONMENTS)}) or "
            "'module.path:ClassName'"
        ]
    if ":" not in name:
        if name in ENVIRONMENTS:
            return ENVIRONMENTS[name], []
        near = difflib.get_close_matches(name, list(ENVIRONMENTS), n=1)
        hint = f"; did you mean {near[0]!r}?" if near else ""
        return None, [
            f"{key} is not a registered environment ({', '.join(ENVIRONMENTS)}) nor "
            f"'module.path:ClassName'{hint}"
        ]
    module, _, attr = name.partition(":")
    try:
        cls = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError, ValueError) as e:
        return None, [f"{key} ('module.path:ClassName') cannot be imported: {e}"]
    if not (inspect.isclass(cls) and issubclass(cls, Environment)):
        return None, [
            f"{key} is not a subclass of rlscale.envs.protocol.Environment (it must define "
            "stops, reset(problem) and step(action) -> Reply)"
        ]
    if inspect.isabstract(cls):
        missing = ", ".join(sorted(cls.__abstractmethods__))
        return None, [f"{key} does not implement the Environment protocol: {missing} missing"]
    return cls, []


@dataclasses.dataclass(frozen=True)
class EnvFactory:
    """Makes one episode's environment: `cls(**kwargs)`; `stops` are its instances'
    (read from the one `make_factory` built). No stops: a single-turn task."""

    cls: type[Environment]
    kwargs: Mapping
    stops: tuple[str, ...]

    def __call__(self) -> Environment:
        return self.cls(**self.kwargs)

    @property
    def multi_turn(self) -> bool:
        return bool(self.stops)


def make_factory(cfg: EnvConfig) -> EnvFactory:
    """The factory of `cfg.name`'s environments, checked at start-up: the class implements
    the protocol, `cfg.kwargs` construct it, and its `stops` are strings.

    Raises:
      sections.InvalidConfigError (a ValueError): every problem, naming `env.name` or
        `env.kwargs`.
    """
    cls, problems = environment_class(cfg.name)
    sections.raise_if(problems)
    try:
        probe = cls(**cfg.kwargs)
    except Exception as e:  # A user's constructor: whatever it raises is the problem.
        sections.raise_if(
            [f"env.kwargs={dict(cfg.kwargs)!r} do not construct env.name={cfg.name!r}: {e!r}"]
        )
    stops = probe.stops
    if not isinstance(stops, (tuple, list)) or not all(isinstance(s, str) and s for s in stops):
        sections.raise_if(
            [f"env.name={cfg.name!r}: stops={stops!r} must be a tuple of non-empty strings"]
        )
    return EnvFactory(cls, dict(cfg.kwargs), tuple(stops))


def action_stops(factory: EnvFactory, cfg: EnvConfig, tokenizer, max_new_tokens: int):
    """The environment's stops as token-id sequences of the run's tokenizer (each encoded
    without a BOS, as the policy writes it after other text): what the generator stops a
    turn at. Checked at start-up: each is 1 to `MAX_ACTION_STOP` ids that decode back to
    the stop; an episode can hold a turn (the longest stop, one reply token and one token
    more within `sampling.max_new_tokens`); one process (every process would step its own
    environments, and their replies, timed by wall-clock, could differ).

    Raises:
      sections.InvalidConfigError (a ValueError): every problem, each naming its key.
    """
    problems, out = [], []
    for stop in factory.stops:
        ids = tuple(int(i) for i in tokenizer.encode(stop))
        back = tokenizer.decode(ids) if ids else ""
        if not 1 <= len(ids) <= MAX_ACTION_STOP or back != stop:
            problems.append(
                f"env.name={cfg.name!r}: the stop {stop!r} is not producible by the run's "
                f"tokenizer: it encodes to {len(ids)} id(s) {list(ids)[:10]}, which decode to "
                f"{back!r} (a stop must be 1 to {MAX_ACTION_STOP} ids that decode back to it)"
            )
        out.append(ids)
    if factory.stops and not problems:
        need = max(map(len, out)) + 2
        if max_new_tokens < need:
            problems.append(
                f"sampling.max_new_tokens={max_new_tokens} cannot hold one turn of "
                f"env.name={cfg.name!r}: its longest stop is {need - 2} token(s), plus one reply "
                f"token and one more of the policy's: at least {need}"
            )
    if factory.stops and jax.process_count() > 1:
        problems.append(
            f"env.name={cfg.name!r} (multi-turn) runs in one process; {jax.process_count()} "
            "processes were started"
        )
    sections.raise_if(problems)
    return tuple(out)
