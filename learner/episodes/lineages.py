"""What the learner's ledger keeps of each worker process's groups, to read a dead one's lineage.

A dead process's lineage file (envpool/lineage.py) says how many episodes it announced and the
numbers of its first and last group; the ledger counts what it never heard of as `worker_lost`
without ids. A result of such a group may still arrive (pushed again to a restarted learner,
or held through its greeting): it is received, so it must leave the id-less count. Whether a
group is one of the unheard needs the groups the ledger did hear of, which are:

- every group below the `next_group` of the process's hello (its `started` covers them all);
- the announcements (`GroupStarted`) heard after that, which arrive in order on the process's
  one connection: runs of consecutive numbers, broken only where a learner that died took some
  with it, or where a new learner session moved the numbering on.

So a process costs a number and a few runs, not a set of every group it started
(`CountedGroups`). A dead process the lineage named keeps its id-less count and the range of
its group numbers (`Retired`); results of groups nobody announced that arrive before any
lineage says whose they are wait in a per-worker tally (`claim` takes them from it).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from millstream.shared.wire import MAX_COUNT

__all__ = ["EVERYTHING", "CountedGroups", "Retired", "claim", "load_retired"]

#: `below` of a process restored from a checkpoint that predates this record: everything
#: counts as heard, so nothing is taken back from an id-less count (as before the record).
EVERYTHING = 2**62


class CountedGroups:
    """Group numbers of one process that its `started` count covers."""

    __slots__ = ("below", "runs")

    def __init__(self, below: int = 0, runs: list[list[int]] | None = None) -> None:
        #: Every number of the process below this is covered (its hello's `next_group`).
        self.below = below
        #: Heard announcements at or above `below`: [first, last] runs, inclusive.
        self.runs: list[list[int]] = runs if runs is not None else []

    def cover_below(self, next_group: int) -> None:
        """A hello: its `started` covers every group it numbered below `next_group`."""
        self.below = max(self.below, next_group)
        self.runs = [run for run in self.runs if run[1] >= self.below]

    def add(self, number: int, stride: int) -> None:
        """A heard announcement. `stride`: the worker count (a process's numbers step by it)."""
        if number in self:
            return
        if self.runs and number == self.runs[-1][1] + stride:
            self.runs[-1][1] = number
        else:
            self.runs.append([number, number])

    def __contains__(self, number: int) -> bool:
        return number < self.below or any(first <= number <= last for first, last in self.runs)

    def state(self) -> list[Any]:
        return [self.below, [list(run) for run in self.runs]]

    @classmethod
    def from_state(cls, state: list[Any]) -> CountedGroups:
        below, runs = state
        return cls(int(below), [[int(first), int(last)] for first, last in runs])


@dataclass
class Retired:
    """A process a successor's lineage named dead: the episodes it announced that the ledger
    never heard of (counted `worker_lost` without ids), and its group numbers (-1: unknown)."""

    unheard: int = 0
    first_group: int = -1
    last_group: int = -1

    def holds(self, number: int) -> bool:
        return 0 <= self.first_group <= number <= self.last_group


def claim(
    unclaimed: dict[int, Counter[int]], index: int, whose: Callable[[int], bool], limit: int = MAX_COUNT
) -> int:
    """Take worker `index`'s unclaimed results whose group numbers `whose` holds, up to
    `limit`, out of the tally; returns how many."""
    tally = unclaimed.get(index, Counter())
    taken = 0
    for number in sorted(n for n in tally if whose(n)):
        take = min(tally[number], limit - taken)
        taken += take
        tally[number] -= take
        if not tally[number]:
            del tally[number]
    if not tally:
        unclaimed.pop(index, None)
    return taken


def load_retired(state: dict[str, Any]) -> dict[int, dict[str, Retired]]:
    """The ledger's `retired` from a checkpoint: [[process, unheard, first group, last group],
    ...] per index; or older layouts, whose group numbers are unknown: [[process, unheard],
    ...], or a list of processes per index and a separate "unheard" list (before 2026-11-28)."""
    unheard = {(int(i), inc): int(n) for i, inc, n in state.get("unheard", [])}
    retired: dict[int, dict[str, Retired]] = {}
    for i, incs in state.get("retired", {}).items():
        index, kept = int(i), {}
        for entry in incs:
            if isinstance(entry, str):
                kept[entry] = Retired(unheard.get((index, entry), 0))
            else:
                kept[str(entry[0])] = Retired(*(int(n) for n in entry[1:4]))
        retired[index] = kept
    return retired
