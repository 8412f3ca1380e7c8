"""Which groups each envpool worker process started, so a worker that dies loses no episode.

Every worker process says `WorkerHello(index, incarnation)` when it starts and
`GroupStarted(...)` before it runs a group's members; every member later reports exactly once
(a `Trajectory` or an `EpisodeFailed`). The ledger keeps, per started group, the members that
have not reported yet.

When worker `index` says hello with a new incarnation, its previous process is gone (the
launcher restarted it): every member that process started and never reported is closed as an
`EpisodeFailed` with cause `worker_lost`, which the learner feeds to the replay buffer like any
failure. So the accounting stays exact across worker deaths, with nothing waiting forever for
members that cannot come. A report that arrives after its group was closed is a duplicate to
the buffer (same episode id) and is counted as such.

The ledger also says where each worker index continues numbering (`next_groups`, announced in
`PolicyVersion`): after the last group any of its processes started, so a restarted worker
never reuses a group number.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from millstream.shared.protocol import Cause, EpisodeFailed, GroupStarted, WorkerHello, group_number

__all__ = ["WorkerLedger"]


@dataclass
class _OpenGroup:
    index: int
    incarnation: str
    size: int
    pending: set[str] = field(default_factory=set)


class WorkerLedger:
    def __init__(self, workers: int, group_base: int) -> None:
        self.workers = workers
        #: The live process of each worker index.
        self.incarnations: dict[int, str] = {}
        self.open: dict[str, _OpenGroup] = {}
        #: Per worker index, the first group number its next process may use.
        self.next_groups = [group_base + i for i in range(workers)]
        #: Episodes started, per (index, incarnation).
        self.started: Counter[tuple[int, str]] = Counter()
        self.lost = 0
        self.restarts = 0

    def rebase(self, group_base: int) -> None:
        """A resumed session numbers from `group_base`."""
        self.next_groups = [max(n, group_base + i) for i, n in enumerate(self.next_groups)]

    def hello(self, msg: WorkerHello) -> list[EpisodeFailed]:
        """A worker process started; returns the failures of its predecessor's lost members."""
        before = self.incarnations.get(msg.index)
        self.incarnations[msg.index] = msg.incarnation
        if before is None or before == msg.incarnation:
            return []
        self.restarts += 1
        return self._close(msg.index, before)

    def group_started(self, msg: GroupStarted) -> None:
        self.incarnations.setdefault(msg.index, msg.incarnation)
        self.open[msg.group_id] = _OpenGroup(
            msg.index,
            msg.incarnation,
            msg.group_size,
            {f"{msg.group_id}-e{m}" for m in range(msg.group_size)},
        )
        self.started[(msg.index, msg.incarnation)] += msg.group_size
        if 0 <= msg.index < self.workers:
            self.next_groups[msg.index] = max(
                self.next_groups[msg.index], group_number(msg.group_id) + self.workers
            )

    def reported(self, episode_id: str, group_id: str) -> None:
        group = self.open.get(group_id)
        if group is None:
            return
        group.pending.discard(episode_id)
        if not group.pending:
            del self.open[group_id]

    def started_by_live(self, index: int) -> int:
        """Episodes the live process of worker `index` started."""
        incarnation = self.incarnations.get(index)
        return 0 if incarnation is None else self.started[(index, incarnation)]

    @property
    def started_total(self) -> int:
        return sum(self.started.values())

    def _close(self, index: int, incarnation: str) -> list[EpisodeFailed]:
        failures = []
        for gid, group in list(self.open.items()):
            if group.incarnation != incarnation:
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
        }
