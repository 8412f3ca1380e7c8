"""Limits the config implies: the largest frame a socket of the run must accept.

`transport.max_frame_bytes` bounds every socket (shared/wire/transport.py: `limit_socket`). Left
at 0 it is derived here from what the run can legitimately send, so a user never sets it; set by
hand, it is checked against the same bound.
"""

from __future__ import annotations

from millstream.shared.config.meta import ConfigError
from millstream.shared.config.schema import Config

__all__ = ["frame_limit", "BYTES_PER_TOKEN", "MIN_FRAME_BYTES"]


#: Encoded bytes a trajectory may take per token, at most: the id, the loss mask, the logprob and
#: the version (about 20 bytes in msgpack) and the decoded text kept for inspection.
BYTES_PER_TOKEN = 48
#: Room for what is not per token: ids, anchors, per-turn lists, the frame's envelope.
FRAME_SLACK_BYTES = 1 << 20
#: The derived limit is never below this: the attack it bounds is gigabytes, not megabytes.
MIN_FRAME_BYTES = 16 << 20


def frame_limit(cfg: Config) -> int:
    """`transport.max_frame_bytes`, or the limit derived from the config when it is 0; a
    ConfigError when a given one is below what the run's own largest message may need."""
    # An episode holds at most max_turns contexts (a new context per turn, Delethink's chunks)
    # of at most max_model_len tokens each.
    needed = BYTES_PER_TOKEN * cfg.actor.max_model_len * cfg.envpool.max_turns + FRAME_SLACK_BYTES
    given = cfg.transport.max_frame_bytes
    if given == 0:
        return max(MIN_FRAME_BYTES, needed)
    if given < needed:
        raise ConfigError(
            f"transport.max_frame_bytes = {given}: below the {needed} bytes one trajectory of this "
            f"config may need (actor.max_model_len {cfg.actor.max_model_len} x envpool.max_turns "
            f"{cfg.envpool.max_turns} tokens); raise it, or 0 to derive it"
        )
    return given
