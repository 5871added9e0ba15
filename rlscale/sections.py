"""The base of a typed config section: a frozen dataclass owned by the module that reads it,
whose fields are its config keys and which checks itself on construction (`problems`, each
naming its key as `section.key=value`). `rl.resolve` builds every section of a run's
ConfigDict at once with the checks deferred (`deferred`), so that it lists every problem of
every section together.
"""

import contextlib
import contextvars

_DEFERRED = contextvars.ContextVar("rlscale_sections_deferred", default=False)


class InvalidConfigError(ValueError):
    """Every problem of a config, one a line (`problems`: each naming its key)."""

    def __init__(self, problems: list[str]):
        super().__init__("Invalid config:\n  " + "\n  ".join(problems))
        self.problems = list(problems)


def raise_if(problems: list[str]) -> None:
    if problems:
        raise InvalidConfigError(problems)


class Section:
    """Mixin of a frozen section dataclass: `problems()` lists what is wrong with its values;
    construction raises `InvalidConfigError` with them unless inside `deferred()`."""

    def problems(self) -> list[str]:
        return []

    def __post_init__(self):
        if not _DEFERRED.get():
            raise_if(self.problems())


@contextlib.contextmanager
def deferred():
    """Sections built inside are not checked: the caller collects their `problems()`."""
    token = _DEFERRED.set(True)
    try:
        yield
    finally:
        _DEFERRED.reset(token)


def at_least(key: str, value, low: int) -> list[str]:
    """`key=value` when it is not an integer >= `low`: the problem, naming the key."""
    if not isinstance(value, int) or value < low:
        return [f"{key}={value!r} must be an integer >= {low}"]
    return []
