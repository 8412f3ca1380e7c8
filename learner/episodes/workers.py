"""Which groups each envpool worker process started, so no death of a worker or of the learner
loses an episode without a count.

Every worker process says `WorkerHello` to each learner session it sees (the first, and a
restarted learner's) and `GroupStarted` before it runs a group's members; every member later
reports exactly once (a `Trajectory` or an `EpisodeFailed`). The ledger keeps, per started group,
the members that have not reported yet, and per worker process how many episodes it started.

- **A worker dies.** When worker `index` says hello with a new incarnation, its previous process
  is gone (the launcher restarted it): every member that process started and never reported is
  closed as an `EpisodeFailed` with cause `worker_lost`, which the learner feeds to the replay
  buffer like any failure. A report that arrives after its group was closed is a duplicate to
  the buffer (same episode id) and is counted as such.
- **The learner dies.** The ledger is saved in every checkpoint. A restarted learner loads it,
  and each live worker's hello brings the truth since: how many episodes the process started
  (`started`) and which still run (`live`). Episodes that reached the dead learner after its
  checkpoint are then the difference between what the workers started and what the restored
  learner holds; the learner counts them as `learner_lost` at the end (`unreceived`).

- **Both, or a death mid-send.** A process can die with `GroupStarted` still in its queues, or
  die while a learner dies before its next checkpoint: the learner never hears of those groups.
  Each process writes how many episodes it announced to a file its successor reads
  (envpool/lineage.py) and names in its hello (`lineage`): what the dead processes announced
  beyond what the ledger heard is counted `worker_lost` at once (their ids are not known; the
  count is kept per dead process, in `retired`). A named process is retired: a hello of it
  (reordered behind its successor's) is refused, and an announcement of it that arrives late is
  one of those counted, now known by id (the count moves from its process's id-less count to
  the group's members, each `worker_lost`); one past
  what the lineage said is a dead process's group too, started and lost together. The lineage
  is taken on the worker key's word, as its results are: a forged one can misreport only that
  worker's own episodes.

The ledger also says where each worker index continues numbering (`next_groups`, announced in
`PolicyVersion`): after the last group any of its processes started, so no group number is
used twice.

And it counts, per live worker process, the results of it the learner took (`credit`), so that
a checkpoint can say how many of them it holds (`settled()`, announced in `PolicyVersion`): the
worker keeps the rest and pushes them again to a restarted learner (envpool/redelivery.py),
which turns most of what used to be `learner_lost` into episodes received after all.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from millstream.shared.wire import (
    Cause,
    EpisodeFailed,
    GroupStarted,
    Settled,
    WorkerHello,
    group_number,
    group_of,
    member_id,
)

__all__ = ["WorkerLedger"]

#: Retired processes remembered per worker index (their late announcements are recognised).
_RETIRED_KEPT = 16


@dataclass
class _OpenGroup:
    index: int
    incarnation: str
    size: int
    pending: set[str] = field(default_factory=set)


class WorkerLedger:
    def __init__(self, workers: int, group_base: int, group_size: int) -> None:
        self.workers = workers
        self.group_size = group_size
        #: The live process of each worker index.
        self.incarnations: dict[int, str] = {}
        self.open: dict[str, _OpenGroup] = {}
        #: Per worker index, the first group number its next process may use.
        self.next_groups = [group_base + i for i in range(workers)]
        #: Episodes started, per (index, incarnation).
        self.started: Counter[tuple[int, str]] = Counter()
        self.lost = 0
        self.restarts = 0
        #: Worker indices that said hello to this learner session.
        self.greeted: set[int] = set()
        #: Results taken per live worker process (index, incarnation), from its hello on (`hello`
        #: sets it to all it pushed before: learner/episodes/intake.py counts the rest), so that
        #: "n" means "the first n it pushed".
        self.reports: Counter[tuple[int, str]] = Counter()
        #: `reports` as the latest saved checkpoint holds them.
        self.saved_reports: dict[tuple[int, str], int] = {}
        #: Per worker index, its processes a successor's lineage named dead, newest last (at
        #: most `_RETIRED_KEPT`): a hello or announcement from one of them comes late. Each
        #: with the episodes its lineage counted lost that the ledger never heard announced:
        #: a late announcement of that process is one of them.
        self.retired: dict[int, dict[str, int]] = {}
        #: Episodes counted `worker_lost` from lineages, without ids (late announcements take
        #: theirs back: they are lost by id then).
        self.lost_unheard = 0
        #: Announcements of retired processes that arrived after their successor's hello.
        self.late_groups = 0

    def rebase(self, group_base: int) -> None:
        """Numbering continues from `group_base` (a resumed session's, or past every worker's)."""
        self.next_groups = [max(n, group_base + i) for i, n in enumerate(self.next_groups)]

    def hello(
        self, msg: WorkerHello, may_own: Callable[[str], bool] = lambda gid: True
    ) -> tuple[list[EpisodeFailed], int]:
        """A worker process introduced itself (its index is in range: learner/episodes/intake.py);
        returns the failures of a dead predecessor's unreported members, and how many episodes
        its dead predecessors announced that the ledger never heard of (`worker_lost`, no ids).
        `may_own(gid)` says whether a live group it names may be its own (the intake's
        numbering rule)."""
        self.greeted.add(msg.index)
        before = self.incarnations.get(msg.index)
        self.incarnations[msg.index] = msg.incarnation
        lost = []
        if before is not None and before != msg.incarnation:
            self.restarts += 1
            lost = self._close(msg.index, before)
            self.reports.pop((msg.index, before), None)  # that process is gone: nothing to settle
        unheard = self._hear_lineage(msg)
        key = (msg.index, msg.incarnation)
        self.started[key] = max(self.started[key], msg.started)  # the worker's count is the truth
        # Every result it pushed came before this hello on its one connection (pushed again if
        # a dead learner had it), and no step is taken while greeting: the next checkpoint holds
        # all of them.
        self.reports[key] = max(self.reports[key], min(msg.reported, msg.started))
        self._reopen(msg.index, msg.incarnation, msg.live, may_own)
        if 0 <= msg.index < self.workers:
            self.next_groups[msg.index] = max(self.next_groups[msg.index], msg.next_group)
        return lost, unheard

    def is_retired(self, index: int, incarnation: str) -> bool:
        """Whether a successor's lineage named this process dead."""
        return incarnation in self.retired.get(index, {})

    def group_started(self, msg: GroupStarted) -> tuple[list[EpisodeFailed], int]:
        """A group announced. From a retired process (late): its members as `worker_lost`
        failures, and how many of them its lineage had counted without ids (to count again by
        id: the caller takes them back from the id-less count)."""
        key = (msg.index, msg.incarnation)
        if 0 <= msg.index < self.workers:
            self.next_groups[msg.index] = max(
                self.next_groups[msg.index], group_number(msg.group_id) + self.workers
            )
        members = {member_id(msg.group_id, m) for m in range(msg.group_size)}
        if self.is_retired(msg.index, msg.incarnation):
            self.late_groups += 1
            unheard = self.retired[msg.index]
            counted = msg.group_size if unheard[msg.incarnation] >= msg.group_size else 0
            unheard[msg.incarnation] -= counted
            self.lost_unheard -= counted
            self.started[key] += msg.group_size - counted  # past the lineage: started now
            self.open[msg.group_id] = _OpenGroup(msg.index, msg.incarnation, msg.group_size, members)
            return self._close(msg.index, msg.incarnation), counted
        self.incarnations.setdefault(msg.index, msg.incarnation)
        self.open[msg.group_id] = _OpenGroup(msg.index, msg.incarnation, msg.group_size, members)
        self.started[key] += msg.group_size
        return [], 0

    def owner(self, group_id: str) -> int | None:
        """The worker index that started this group, while it has members to report."""
        group = self.open.get(group_id)
        return None if group is None else group.index

    def expects(self, episode_id: str, group_id: str) -> bool:
        """Whether a worker started this episode and it has not reported yet."""
        group = self.open.get(group_id)
        return group is not None and episode_id in group.pending

    def reported(self, episode_id: str, group_id: str) -> None:
        group = self.open.get(group_id)
        if group is None:
            return
        group.pending.discard(episode_id)
        if not group.pending:
            del self.open[group_id]

    def reporter(self, group_id: str) -> tuple[int, str] | None:
        """The worker process (index, incarnation) that started `group_id`, while it is open."""
        group = self.open.get(group_id)
        return None if group is None else (group.index, group.incarnation)

    def credit(self, process: tuple[int, str]) -> None:
        """One more result of `process` taken (counted by the buffer, not a duplicate)."""
        self.reports[process] += 1

    def mark_saved(self, state: dict[str, Any]) -> None:
        """A checkpoint holding this `state_dict()` was saved: its counts are what the workers
        may forget."""
        self.saved_reports = {(int(i), inc): int(n) for i, inc, n in state.get("reports", [])}

    def settled(self) -> list[Settled]:
        """`PolicyVersion.settled`: the saved counts of the live worker processes."""
        return [
            Settled(index, incarnation, self.saved_reports[(index, incarnation)])
            for index, incarnation in sorted(self.incarnations.items())
            if (index, incarnation) in self.saved_reports
        ]

    def started_by_live(self, index: int) -> int:
        """Episodes the live process of worker `index` started."""
        incarnation = self.incarnations.get(index)
        return 0 if incarnation is None else self.started[(index, incarnation)]

    @property
    def started_total(self) -> int:
        return sum(self.started.values())

    def _reopen(self, index: int, incarnation: str, live: list[str], may_own: Callable[[str], bool]) -> None:
        """After a learner restart the checkpoint's open groups are out of date: what runs now
        is what the worker says, about its own groups only."""
        running: dict[str, set[str]] = {}
        for eid in live:
            running.setdefault(group_of(eid), set()).add(eid)
        for gid, group in list(self.open.items()):
            if group.index == index and group.incarnation == incarnation and gid not in running:
                del self.open[gid]  # its members reported (to this learner or a dead one)
        for gid, members in running.items():
            known = self.open.get(gid)
            if (known is not None and known.index != index) or not may_own(gid):
                continue  # another worker's group: not this one's to reopen
            size = known.size if known is not None else self.group_size
            self.open[gid] = _OpenGroup(index, incarnation, size, members)

    def _retire(self, index: int, incarnation: str) -> None:
        """`incarnation` of worker `index` is dead (a successor said hello, or named it)."""
        retired = self.retired.setdefault(index, {})
        if incarnation in retired:
            return
        retired[incarnation] = 0
        while len(retired) > _RETIRED_KEPT:
            del retired[next(iter(retired))]  # the oldest: dicts keep insertion order

    def _hear_lineage(self, msg: WorkerHello) -> int:
        """Count what the dead processes a hello names announced beyond what the ledger heard
        (started, and lost at once); returns how many."""
        total = 0
        for dead in msg.lineage:
            if dead.incarnation == msg.incarnation:
                continue  # not dead: a hello never names its own process
            self._retire(msg.index, dead.incarnation)
            key = (msg.index, dead.incarnation)
            unheard = dead.announced - self.started[key]
            if unheard > 0:
                self.started[key] = dead.announced
                self.retired[msg.index][dead.incarnation] += unheard
                total += unheard
        self.lost_unheard += total
        return total

    def _close(self, index: int, incarnation: str) -> list[EpisodeFailed]:
        failures = []
        for gid, group in list(self.open.items()):
            if group.index != index or group.incarnation != incarnation:
                continue
            failures += [
                EpisodeFailed(
                    eid,
                    gid,
                    group.size,
                    Cause.WORKER_LOST,
                    f"envpool worker {index} (process {incarnation}) died before this episode reported",
                )
                for eid in sorted(group.pending)
            ]
            del self.open[gid]
        self.lost += len(failures)
        return failures

    def statistics(self) -> dict[str, int]:
        return {
            "open_groups": len(self.open),
            "worker_restarts": self.restarts,
            "worker_lost": self.lost,
            "worker_lost_unheard": self.lost_unheard,
            "late_groups": self.late_groups,
        }

    # --- checkpoints -------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {
            "incarnations": {str(i): inc for i, inc in self.incarnations.items()},
            "open": {
                gid: [g.index, g.incarnation, g.size, sorted(g.pending)] for gid, g in self.open.items()
            },
            "next_groups": list(self.next_groups),
            "started": [[i, inc, n] for (i, inc), n in self.started.items()],
            "lost": self.lost,
            "restarts": self.restarts,
            "reports": [[i, inc, n] for (i, inc), n in self.reports.items()],
            "retired": {str(i): [[inc, n] for inc, n in incs.items()] for i, incs in self.retired.items()},
            "lost_unheard": self.lost_unheard,
            "late_groups": self.late_groups,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.incarnations = {int(i): inc for i, inc in state["incarnations"].items()}
        self.open = {
            gid: _OpenGroup(int(i), inc, int(size), set(pending))
            for gid, (i, inc, size, pending) in state["open"].items()
        }
        saved = [int(n) for n in state["next_groups"]]
        self.next_groups = [max(a, b) for a, b in zip(self.next_groups, saved)] + saved[
            len(self.next_groups) :
        ]
        self.next_groups = self.next_groups[: self.workers]
        self.started = Counter({(int(i), inc): int(n) for i, inc, n in state["started"]})
        self.lost, self.restarts = int(state["lost"]), int(state["restarts"])
        self.reports = Counter({(int(i), inc): int(n) for i, inc, n in state.get("reports", [])})
        self.retired = _load_retired(state)
        self.lost_unheard = int(state.get("lost_unheard", 0))
        self.late_groups = int(state.get("late_groups", 0))
        self.mark_saved(state)  # a checkpoint holds what it says, by definition


def _load_retired(state: dict[str, Any]) -> dict[int, dict[str, int]]:
    """`retired` from a checkpoint: [[process, unheard], ...] per index, or the layout before
    2026-11-28 (a list of processes per index and a separate "unheard" list)."""
    unheard = {(int(i), inc): int(n) for i, inc, n in state.get("unheard", [])}
    retired: dict[int, dict[str, int]] = {}
    for i, incs in state.get("retired", {}).items():
        index, kept = int(i), {}
        for entry in incs:  # [process, unheard], or the older layout's process alone
            if isinstance(entry, str):
                kept[entry] = unheard.get((index, entry), 0)
            else:
                kept[str(entry[0])] = int(entry[1])
        retired[index] = kept
    return retired
