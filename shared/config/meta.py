"""How a config field carries its documentation: `doc(text, **constraints)` is the
`msgspec.Meta` every section's fields are annotated with (`millstream config` prints it), shared by
the modules that hold the sections; and `ConfigError`, what every check of the config raises.
"""

from __future__ import annotations

from typing import Any

import msgspec

__all__ = ["doc", "ConfigError"]


class ConfigError(ValueError):
    """A config file or override is invalid; the message names the key."""


def doc(text: str, **constraints: Any) -> msgspec.Meta:
    """A field's one-line documentation and its range or length constraints."""
    return msgspec.Meta(description=text, **constraints)
