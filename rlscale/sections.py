"""The base of a typed config section: a frozen dataclass owned by the module that reads it,
whose fields are its config keys and which checks itself on construction (`problems`, each
naming its key as `section.key=value`). `rl.resolve` builds every section of a run's
ConfigDict at once with the checks deferred (`deferred`, `build`), so that it lists every
problem of every section together; so does the smaller resolve of the commands that sample a
saved policy (`saved_policy.resolve`).
"""

import contextlib
import contextvars
import dataclasses

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


def _values(node) -> dict:
    """A section's values, tuples for lists (a ConfigDict may hold either)."""
    d = node.to_dict() if hasattr(node, "to_dict") else dict(node)
    return {k: tuple(v) if isinstance(v, list) else v for k, v in d.items()}


def build(config, classes: dict, problems: list[str]) -> dict:
    """Each section `classes` names (config key -> the dataclass that owns it) built from its
    keys in `config`, its checks deferred; each one's problems added to `problems`, and a key
    its dataclass does not know is a problem too."""
    built = {}
    with deferred():
        for key, cls in classes.items():
            values = _values(config[key])
            names = {f.name for f in dataclasses.fields(cls)}
            unknown = sorted(set(values) - names)
            if unknown:
                problems.append(f"{key}: unknown keys {unknown}; keys: {', '.join(sorted(names))}")
            built[key] = cls(**{k: v for k, v in values.items() if k in names})
            problems += built[key].problems()
    return built
