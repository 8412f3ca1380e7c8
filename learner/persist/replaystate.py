"""The replay buffer's part of a checkpoint: its groups, counters and memory as plain data.

`buffer_state(buffer)` turns a `ReplayBuffer` (learner/replay.py) into plain containers and
`Trajectory` structs, which msgspec encodes as they are; `load_buffer_state(buffer, state)` puts
such a state (possibly through a msgpack round trip) back into a buffer of the same shape.
learner/persist/checkpoint.py writes the state to disk with the rest of the checkpoint.

This module reads and writes the buffer's own fields, the private ones included: the state is
the buffer's layout written out, and keeping the format here keeps the buffer about groups and
accounts, and the file format beside the checkpoint that stores it. `STATE_FORMAT` names the
layout; format 1 (every episode id of the run in one list) is read and converted, any other is
refused rather than guessed at. Format 2 keeps ids per group only while a group can still be sent
to, and finished groups as number ranges (learner/seen.py), so a checkpoint's size no longer
grows with the length of the run.

Partial groups survive a resume: their missing members still come. After a learner restart
the workers that ran them report them, or push them again if they reached the dead learner
(envpool/redelivery.py); a worker that died too, or a whole run resumed with new workers, has
them closed as `worker_lost` when its successor says hello (learner/episodes/workers.py); one
that never completes is dropped as stale like any partial group, or at the end of the run.
`drop_partial_cause` drops them instead (counted under it, as `ReplayBuffer.drain` would, and
remembered as closed so a late member is counted under the same cause). The accounting identity
holds before and after a load, and a state that breaks it is refused before anything in the
buffer changes.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import msgspec

from millstream.learner.replay import Group, Pending, ReplayBuffer
from millstream.learner.seen import SeenEpisodes
from millstream.shared.wire import DropCause, Trajectory

__all__ = ["STATE_FORMAT", "buffer_state", "load_buffer_state"]

#: Layout version of `buffer_state`; `load_buffer_state` reads it and format 1, refuses others.
STATE_FORMAT = 2


def buffer_state(buffer: ReplayBuffer) -> dict[str, Any]:
    """Everything needed to resume, as plain containers and `Trajectory` structs (msgspec
    encodes it as is). Complete groups are listed in FIFO order; lists are copies."""
    return {
        "format": STATE_FORMAT,
        "group_size": buffer.group_size,
        "complete": [
            {
                "group_id": g.group_id,
                "trajectories": list(g.trajectories),
                "failed": g.failed,
                "oldest_version": g.oldest_version,
            }
            for g in buffer._complete.values()
        ],
        "partial": [
            {
                "group_id": gid,
                "trajectories": list(p.trajectories),
                "failed": p.failed,
                "oldest": p.oldest,
            }
            for gid, p in buffer._pending.items()
        ],
        "counters": {
            "received": buffer.received,
            "trained": buffer.trained,
            "duplicates": buffer.duplicates,
            "resent_duplicates": buffer.resent_duplicates,
            "buffered": buffer.buffered,
            "dropped_groups": buffer.dropped_groups,
            "dropped": dict(buffer.dropped),
            "failed": dict(buffer.failed),
            "refused": dict(buffer.refused),
        },
        "seen": buffer._seen.state(),
        "closed": dict(buffer._closed),
        "last_staleness": list(buffer._last_staleness),
    }


def _pending(trajectories: list[Trajectory], failed: int, oldest: int | None) -> Pending:
    """A partial group as the buffer held it (its identity is its first trajectory's)."""
    identity = (trajectories[0].env, trajectories[0].seed) if trajectories else None
    return Pending(trajectories, failed, oldest, identity)


def load_buffer_state(
    buffer: ReplayBuffer,
    state: dict[str, Any],
    *,
    drop_partial_cause: DropCause | None = None,
) -> int:
    """Replaces `buffer`'s contents with `state` (from `buffer_state`, possibly through a
    msgpack round trip); returns how many complete groups were restored.

    Partial groups are kept, or dropped under `drop_partial_cause` as `drain` would drop them
    (a late member is then counted under the same cause). The accounting identity holds before
    and after.
    Raises ValueError if `state` is of another format or group size, is inconsistent, or
    holds more than `max_groups` complete groups.
    """
    if state.get("format") not in (1, STATE_FORMAT):
        raise ValueError(
            f"replay buffer state has format {state.get('format')!r}, this code reads format {STATE_FORMAT}"
        )
    if state["group_size"] != buffer.group_size:
        raise ValueError(
            f"replay buffer state was saved with group_size="
            f"{state['group_size']}, the buffer uses {buffer.group_size}: "
            "train.group_size cannot change across a resume"
        )
    if len(state["complete"]) > buffer.max_groups:
        raise ValueError(
            f"replay buffer state holds {len(state['complete'])} complete "
            f"groups, more than max_groups={buffer.max_groups}"
        )

    def trajectories(raw: list) -> list[Trajectory]:
        return [msgspec.convert(t, Trajectory) for t in raw]

    complete: OrderedDict[str, Group] = OrderedDict()
    for g in state["complete"]:
        complete[g["group_id"]] = Group(
            g["group_id"], trajectories(g["trajectories"]), int(g["failed"]), int(g["oldest_version"])
        )
    partial = {
        p["group_id"]: _pending(trajectories(p["trajectories"]), int(p["failed"]), p["oldest"])
        for p in state["partial"]
    }
    c = state["counters"]
    held = sum(len(g.trajectories) for g in complete.values()) + sum(
        len(p.trajectories) for p in partial.values()
    )
    gone = c["trained"] + sum(c["dropped"].values()) + sum(c["failed"].values())
    if c["buffered"] != held or c["received"] != gone + held:
        raise ValueError(f"replay buffer state is inconsistent: {held} trajectories held, counters {c}")

    closed = {gid: DropCause(cause) for gid, cause in state["closed"].items()}
    seen = (
        SeenEpisodes.from_ids(state["seen"])
        if state["format"] == 1
        else SeenEpisodes.from_state(state["seen"])
    )
    # Nothing above changed the buffer: a bad state leaves it as it was.
    buffer._complete, buffer._pending, buffer._closed, buffer._seen = complete, {}, closed, seen
    buffer.received, buffer.trained = int(c["received"]), int(c["trained"])
    buffer.duplicates, buffer.buffered = int(c["duplicates"]), int(c["buffered"])
    buffer.resent_duplicates = int(c.get("resent_duplicates", 0))
    buffer.dropped_groups = int(c["dropped_groups"])
    buffer.dropped, buffer.failed = dict(c["dropped"]), dict(c["failed"])
    buffer.refused = dict(c.get("refused", {}))
    buffer._last_staleness = list(state.get("last_staleness", []))
    if drop_partial_cause is None:
        buffer._pending = partial
    else:
        for gid, group in partial.items():
            buffer._closed[gid] = drop_partial_cause
            buffer._drop_group(gid, group.trajectories, drop_partial_cause)
    for gid in list(buffer._closed):  # a format 1 state kept every group: finish those done
        buffer._settle(gid)
    return len(buffer._complete)
