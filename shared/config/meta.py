"""How a config field carries its documentation: `doc(text, **constraints)` is the
`msgspec.Meta` every section's fields are annotated with (`millstream config` prints it), shared by
the modules that hold the sections; `ConfigError`, what every check of the config raises; and
the pattern the `*.cpus` settings share.
"""

from __future__ import annotations

from typing import Any

import msgspec

__all__ = ["doc", "ConfigError", "CPUS_PATTERN", "toml_value", "show_value"]


class ConfigError(ValueError):
    """A config file or override is invalid; the message names the key."""


def doc(text: str, **constraints: Any) -> msgspec.Meta:
    """A field's one-line documentation and its range or length constraints."""
    return msgspec.Meta(description=text, **constraints)


#: What a `*.cpus` setting may hold: auto, all, or a core list such as "0-3,8"
#: (shared/process/cpus.py reads it).
CPUS_PATTERN = r"^(auto|all|\d+(-\d+)?(,\d+(-\d+)?)*)$"


def toml_value(value: Any) -> str:
    """One value as TOML (inline tables for dicts): also what a `key=value` override takes."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return msgspec.json.encode(value).decode()
    if isinstance(value, dict):
        inner = ", ".join(f"{k} = {toml_value(v)}" for k, v in value.items())
        return "{ " + inner + " }" if inner else "{}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    raise ConfigError(f"cannot write {value!r} as TOML")


def show_value(value: Any) -> str:
    """A setting's value as an error message shows it: as TOML where it is a scalar."""
    return toml_value(value) if isinstance(value, (str, int, float, bool)) else repr(value)
