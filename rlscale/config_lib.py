"""Helpers for `configs/*.py`: variant-string parsing and config pieces shared by recipes.

Every config file defines `get_config(arg=None)`; `arg` is the text after `:` in
`--config configs/X.py:key=value,flag`. `parse_arg` turns it into typed values, rejecting keys
the config does not declare.
"""

import dataclasses

import ml_collections

from rlscale import model


def _convert(key: str, text: str, default):
    if isinstance(default, bool):
        if text.lower() in ("1", "true", "yes", ""):
            return True
        if text.lower() in ("0", "false", "no"):
            return False
        raise ValueError(f"config variant {key}={text!r}: expected a boolean")
    try:
        return type(default)(text) if default is not None else text
    except ValueError:
        raise ValueError(
            f"config variant {key}={text!r}: expected {type(default).__name__}"
        ) from None


def parse_arg(arg: str | None, **spec) -> ml_collections.ConfigDict:
    """Parses `"key=value,flag"` against declared keys and defaults.

    A bare `flag` sets a boolean key to True. Values take the type of their default.

    Raises:
      ValueError: naming an undeclared key or a value of the wrong type.
    """
    values = dict(spec)
    for item in filter(None, (arg or "").split(",")):
        key, _, text = item.partition("=")
        key = key.strip()
        if key not in spec:
            raise ValueError(
                f"unknown config variant {key!r} in {arg!r}; known: {', '.join(sorted(spec))}"
            )
        if not _ and not isinstance(spec[key], bool):
            raise ValueError(f"config variant {key!r} needs a value ({key}=...)")
        values[key] = _convert(key, text.strip(), spec[key])
    return ml_collections.ConfigDict(values)


def model_config(name: str, **overrides) -> ml_collections.ConfigDict:
    """The named architecture as a ConfigDict: every field is overridable from the CLI."""
    return ml_collections.ConfigDict({"name": name, **model.as_dict(model.get(name, **overrides))})


def sampling_config(**overrides) -> ml_collections.ConfigDict:
    from rlscale.sampling import SamplingConfig

    d = dataclasses.asdict(SamplingConfig(**overrides))
    return ml_collections.ConfigDict(d)
