"""The base of every wire message: a tagged msgspec struct encoded as an array.

The messages form one tagged union (shared/wire/protocol.py), so they share one layout: arrays,
not maps (smaller, faster), with the tag first. Each message repeats `frozen=True`: msgspec
inherits it anyway, type checkers do not.
"""

from typing import Annotated

import msgspec

__all__ = ["WireMessage", "Id", "MAX_ID_CHARS"]

#: Longest id a message may carry (episode, group, request, worker and replica names). Ids are
#: remembered (a learner keeps every episode id of the run to refuse a re-sent one), so a peer
#: must not be able to make one as large as a frame: a longer one fails to decode, the frame is
#: refused as malformed, and nothing of it is kept.
MAX_ID_CHARS = 256

Id = Annotated[str, msgspec.Meta(max_length=MAX_ID_CHARS)]


class WireMessage(msgspec.Struct, array_like=True, frozen=True):
    """Base of every message: encoded as a tagged array (the union needs one layout for all)."""
