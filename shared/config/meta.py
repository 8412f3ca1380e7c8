"""How a config field carries its documentation: `doc(text, **constraints)` is the
`msgspec.Meta` every section's fields are annotated with (`millstream config` prints it), shared by
the modules that hold the sections.
"""

from __future__ import annotations

from typing import Any

import msgspec

__all__ = ["doc"]


def doc(text: str, **constraints: Any) -> msgspec.Meta:
    """A field's one-line documentation and its range or length constraints."""
    return msgspec.Meta(description=text, **constraints)
