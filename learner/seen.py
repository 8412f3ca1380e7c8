"""Which episodes the replay buffer has already counted, in memory that ends with each group.

    seen = SeenEpisodes()
    seen.add("g12", "g12-e3")          # counted
    seen.has("g12", "g12-e3")          # True: a re-send is a duplicate, not a second episode
    seen.finish("g12")                 # every slot of g12 is in and the group left the buffer:
    seen.finished("g12")               # its ids are forgotten, its number kept in a NumberSet

The buffer used to keep every episode id of the run in one set (and every group in a dict): a
long run's learner grew by one id per episode for ever, and every checkpoint carried them all.
Ids are needed only while a message for them can still come: while a group is open, and after it
left the buffer until all `group_size` of its slots are in (a stale partial group's late members
still arrive, to be counted). After that a message naming the group is a re-send or a forgery,
and knowing that the group is done is enough to refuse it: so a finished group keeps only its
number, in a set of number ranges. Groups finish roughly in the order they were numbered, so the
ranges merge and the set holds about one range per group still in flight, whatever the length
of the run.
"""

from __future__ import annotations

import bisect
from typing import Any

from millstream.shared.wire import group_number, group_of

__all__ = ["NumberSet", "SeenEpisodes", "number_of"]


class NumberSet:
    """A set of non-negative integers stored as sorted, disjoint, non-adjacent [start, end) ranges."""

    def __init__(self, ranges: list[tuple[int, int]] | None = None) -> None:
        self._starts: list[int] = []
        self._ends: list[int] = []
        for start, end in ranges or []:
            if start >= end or (self._ends and start <= self._ends[-1]):
                raise ValueError(f"number ranges must be sorted, disjoint and apart, got {ranges}")
            self._starts.append(start)
            self._ends.append(end)

    def __contains__(self, number: int) -> bool:
        i = bisect.bisect_right(self._starts, number) - 1
        return i >= 0 and number < self._ends[i]

    def add(self, number: int) -> None:
        if number < 0 or number in self:
            return
        i = bisect.bisect_right(self._starts, number)
        joins_left = i > 0 and self._ends[i - 1] == number
        joins_right = i < len(self._starts) and self._starts[i] == number + 1
        if joins_left and joins_right:
            self._ends[i - 1] = self._ends.pop(i)
            self._starts.pop(i)
        elif joins_left:
            self._ends[i - 1] = number + 1
        elif joins_right:
            self._starts[i] = number
        else:
            self._starts.insert(i, number)
            self._ends.insert(i, number + 1)

    def ranges(self) -> list[tuple[int, int]]:
        return list(zip(self._starts, self._ends))

    def highest(self) -> int | None:
        return self._ends[-1] - 1 if self._ends else None


def number_of(group_id: str) -> int:
    """A group's number; -1 for an id that is not one (never finished, never this session's)."""
    try:
        return group_number(group_id)
    except ValueError:
        return -1


class SeenEpisodes:
    """Episode ids per group while the group can still be sent to; finished groups by number."""

    def __init__(self) -> None:
        self._ids: dict[str, set[str]] = {}
        self._finished = NumberSet()

    def has(self, group_id: str, episode_id: str) -> bool:
        return episode_id in self._ids.get(group_id, ())

    def add(self, group_id: str, episode_id: str) -> None:
        if not self.finished(group_id):  # a finished group's ids are gone for good
            self._ids.setdefault(group_id, set()).add(episode_id)

    def count(self, group_id: str) -> int:
        return len(self._ids.get(group_id, ()))

    def finished(self, group_id: str) -> bool:
        return number_of(group_id) in self._finished

    def finish(self, group_id: str) -> None:
        """Forget the group's ids; a group id that is no run's number keeps none anyway."""
        self._ids.pop(group_id, None)
        self._finished.add(number_of(group_id))

    def highest_finished(self) -> int | None:
        return self._finished.highest()

    def __len__(self) -> int:
        """Episode ids held (what the memory grows with)."""
        return sum(len(ids) for ids in self._ids.values())

    # --- checkpoints -------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        return {
            "ids": {gid: sorted(ids) for gid, ids in self._ids.items()},
            "finished": [list(r) for r in self._finished.ranges()],
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> SeenEpisodes:
        seen = cls()
        seen._finished = NumberSet([(int(a), int(b)) for a, b in state["finished"]])
        seen._ids = {gid: set(ids) for gid, ids in state["ids"].items()}
        return seen

    @classmethod
    def from_ids(cls, episode_ids: list[str]) -> SeenEpisodes:
        """From a flat list of ids `<group>-e<member>` (a format 1 checkpoint's)."""
        seen = cls()
        for eid in episode_ids:
            seen.add(group_of(eid), eid)
        return seen
