"""The base of every wire message: a tagged msgspec struct encoded as an array.

The messages form one tagged union (shared/wire/protocol.py), so they share one layout: arrays,
not maps (smaller, faster), with the tag first. Each message repeats `frozen=True`: msgspec
inherits it anyway, type checkers do not.
"""

import msgspec

__all__ = ["WireMessage"]


class WireMessage(msgspec.Struct, array_like=True, frozen=True):
    """Base of every message: encoded as a tagged array (the union needs one layout for all)."""
