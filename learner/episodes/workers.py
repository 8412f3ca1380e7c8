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
  what the lineage said is a dead process's group too, started and lost together. A result of
  one of those groups that arrives after all (pushed again to a restarted learner before its
  process died, or held through the greeting) is received, not lost: the lineage's group
  numbers say whose it is, the record of what the ledger heard (learner/episodes/lineages.py)
  says it was one of the unheard, and it leaves the id-less count. The lineage
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

from millstream.learner.episodes.lineages import EVERYTHING, CountedGroups, Retired, claim, load_retired
from millstream.shared.wire import (
    Cause,
    EpisodeFailed,
    GroupStarted,
    Predecessor,
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
        #: a late announcement of that process is one of them, and so is a result it pushed
        #: again of a group the ledger does not know (its number is the process's).
        self.retired: dict[int, dict[str, Retired]] = {}
        #: Per worker process, the group numbers its `started` covers (what it said in a hello,
        #: what it announced since): the rest of a dead one's lineage range is what it counted
        #: unheard (learner/episodes/lineages.py).
        self.counted: dict[tuple[int, str], CountedGroups] = {}
        #: Per worker index, results received of groups nobody announced to the ledger, by group
        #: number, before a lineage or a hello said whose they were (`received_unknown`).
        self.unclaimed: dict[int, Counter[int]] = {}
        #: Episodes counted `worker_lost` from lineages, without ids (late announcements take
        #: theirs back: they are lost by id then; a late result takes its own back).
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
        dead, unheard = self._hear_lineage(msg)
        lost += dead
        if before is not None and before != msg.incarnation and not self.is_retired(msg.index, before):
            self.counted.pop((msg.index, before), None)  # dead, and no lineage names it
        key = (msg.index, msg.incarnation)
        self.started[key] = max(self.started[key], msg.started)  # the worker's count is the truth
        self.counted.setdefault(key, CountedGroups()).cover_below(msg.next_group)
        claim(self.unclaimed, msg.index, lambda number: number < msg.next_group)  # its `started` has them
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
        key, number = (msg.index, msg.incarnation), group_number(msg.group_id)
        if 0 <= msg.index < self.workers:
            self.next_groups[msg.index] = max(self.next_groups[msg.index], number + self.workers)
        members = {member_id(msg.group_id, m) for m in range(msg.group_size)}
        self.counted.setdefault(key, CountedGroups()).add(number, self.workers)
        if self.is_retired(msg.index, msg.incarnation):
            self.late_groups += 1
            dead = self.retired[msg.index][msg.incarnation]
            counted = msg.group_size if dead.unheard >= msg.group_size else 0
            dead.unheard -= counted
            self.lost_unheard -= counted
            self.started[key] += msg.group_size - counted  # past the lineage: started now
            self.open[msg.group_id] = _OpenGroup(msg.index, msg.incarnation, msg.group_size, members)
            return self._close(msg.index, msg.incarnation), counted
        self.incarnations.setdefault(msg.index, msg.incarnation)
        self.open[msg.group_id] = _OpenGroup(msg.index, msg.incarnation, msg.group_size, members)
        self.started[key] += msg.group_size
        return [], 0

    def received_unknown(self, index: int, group_id: str) -> bool:
        """A result of a group the ledger does not know was received (held through a greeting,
        pushed again, or from a worker not greeted yet). If a dead process of worker `index`
        started it (its lineage's group numbers hold it) and its lineage counted episodes the
        ledger never heard of, this was one of them, counted lost without an id: it is taken
        back from that count (True: the caller takes it back from the buffer's count too). If
        no lineage named its process yet, it is remembered for the one that will (`unclaimed`).

        A live process's unknown groups are counted by its hello's `started`, and its successor
        numbers past its last group (envpool/gate.py), so the number tells whose it is."""
        try:
            number = group_number(group_id)
        except ValueError:
            return False
        for incarnation, dead in self.retired.get(index, {}).items():
            if not dead.holds(number):
                continue
            if dead.unheard > 0 and not self._counted(index, incarnation, number):
                dead.unheard -= 1
                self.lost_unheard -= 1
                return True
            return False  # a dead process's, heard of (or all its unheard came back already)
        live = self.incarnations.get(index)
        if live is None or not self._counted(index, live, number):
            self.unclaimed.setdefault(index, Counter())[number] += 1
        return False

    def _counted(self, index: int, incarnation: str, number: int) -> bool:
        counted = self.counted.get((index, incarnation))
        return counted is not None and number in counted

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
        retired[incarnation] = Retired()
        while len(retired) > _RETIRED_KEPT:
            oldest = next(iter(retired))  # dicts keep insertion order
            del retired[oldest]
            self.counted.pop((index, oldest), None)

    def _hear_lineage(self, msg: WorkerHello) -> tuple[list[EpisodeFailed], int]:
        """Close the groups of the dead processes a hello names (the one it replaced is not
        always the one the ledger knew as live: a restored checkpoint may predate it), and
        count what they announced beyond what the ledger heard (started, and lost at once);
        returns the failures, and how many were counted without ids."""
        failures, total = [], 0
        for dead in msg.lineage:
            if dead.incarnation == msg.incarnation:
                continue  # not dead: a hello never names its own process
            failures += self._close(msg.index, dead.incarnation)
            self._retire(msg.index, dead.incarnation)
            total += self._count_unheard(msg.index, dead)
        self.lost_unheard += total
        return failures, total

    def _count_unheard(self, index: int, dead: Predecessor) -> int:
        """What a dead process announced beyond what the ledger heard, less its results that
        arrived before its successor's hello of groups the ledger never heard of (received,
        not lost); kept with its retired entry, and returned."""
        retired = self.retired[index][dead.incarnation]
        if dead.first_group >= 0:
            retired.first_group, retired.last_group = dead.first_group, dead.last_group
        key = (index, dead.incarnation)
        unheard = dead.announced - self.started[key]
        if unheard <= 0:
            return 0
        self.started[key] = dead.announced

        def its_unheard(number: int) -> bool:
            return retired.holds(number) and not self._counted(index, dead.incarnation, number)

        unheard -= claim(self.unclaimed, index, its_unheard, limit=unheard)
        retired.unheard += unheard
        return unheard

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
            "retired": {
                str(i): [[inc, r.unheard, r.first_group, r.last_group] for inc, r in incs.items()]
                for i, incs in self.retired.items()
            },
            "lost_unheard": self.lost_unheard,
            "late_groups": self.late_groups,
            "counted": [[i, inc, c.state()] for (i, inc), c in self.counted.items()],
            "unclaimed": [[i, n, k] for i, numbers in self.unclaimed.items() for n, k in numbers.items()],
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
        self.retired = load_retired(state)
        if "counted" in state:
            self.counted = {(int(i), inc): CountedGroups.from_state(c) for i, inc, c in state["counted"]}
        else:  # a checkpoint from before the record: the live processes heard all below where
            # their numbering stood; of the others nothing is known, so nothing is taken back
            self.counted = {
                (i, inc): CountedGroups(
                    self.next_groups[i] if self.incarnations.get(i) == inc else EVERYTHING
                )
                for i, inc in self.started
                if 0 <= i < self.workers
            }
        self.unclaimed = {}
        for i, number, count in state.get("unclaimed", []):
            self.unclaimed.setdefault(int(i), Counter())[int(number)] = int(count)
        self.lost_unheard = int(state.get("lost_unheard", 0))
        self.late_groups = int(state.get("late_groups", 0))
        self.mark_saved(state)  # a checkpoint holds what it says, by definition
