"""How many episodes each process of a worker index announced, in a file that outlives it.

    lineage = Lineage.open(run_dir / "envpool-w0.lineage", incarnation)
    lineage.predecessors        # the dead processes of this index, read at start (for the hello)
    lineage.announce(8, 42)     # each group (its size, its number): queued its GroupStarted,
                                # now count it, then run it
    lineage.numbered_past       # the first group number past every predecessor's (for the gate)

The learner learns what a worker process started from its `GroupStarted` messages. Two deaths
can take some of them with them, and with them the episodes they name, without a count:

- a process killed with `GroupStarted` still in its queues (the outbox, ZeroMQ's buffers);
- a process that dies, and a learner that dies before its next checkpoint: the restarted
  learner only knows the groups that checkpoint held, and the process that could say what it
  started since is gone.

So each process writes its running count to a file once it queued an announcement and before
the group's members run (killed between the two, it ran none of them, and the announcement died
in its memory), and its successor (the launcher starts one with the same index, on the same
machine) reads the file and names the dead processes in its `WorkerHello` (`lineage`). The
learner counts what they started beyond what it heard of as `worker_lost`
(learner/episodes/workers.py).

The file also keeps the numbers of the first and the last group each process announced, for
two reasons. The successor numbers its groups past them (envpool/gate.py): the learner, which
tells a new process where to continue, never heard of the groups whose announcements died, and
a number used twice would make two episodes of one id. And the learner can tell which dead
process a result belongs to when one arrives of a group it never heard announced (pushed again
to a restarted learner, say): such a result was received after all, not lost.

Where the file is: the run directory, which a Ray launch keeps on a filesystem every node
shares (shared/launch/ray). A successor on another node finds it too; a node that died may not
have written its last counts there, and then its announcements are counted as they were before
this file existed (what the learner heard). A resumed run (`run.resume` of a run directory)
reads the previous launch's files: what its processes announced after the checkpoint is
counted `worker_lost` in the resumed run's accounts (it ended with that launch).

The file is a few fixed-width lines, `<incarnation> <count> <first group> <last group>`, the
newest last (a line of the older `<incarnation> <count>` layout still reads, with no numbers).
Each process rewrites it whole once at start (the last `MAX_PREDECESSORS` predecessors that
announced anything, and itself, through a rename) and then overwrites only its own three
numbers in place: one `pwrite` of 62 bytes per group, to the page cache. A process killed
mid-write leaves the line it had (a write that small, within one page, is not torn by a process
death: the file is at most a few hundred bytes).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from millstream.shared.wire import MAX_COUNT, MAX_PREDECESSORS, Predecessor

__all__ = ["Lineage"]

log = logging.getLogger("envpool")

_COUNT_DIGITS = 20


class Lineage:
    """This process's announced count, kept in `path` for its successor; the predecessors'."""

    def __init__(self, predecessors: list[Predecessor], fd: int | None, offset: int) -> None:
        #: The dead processes of this index, oldest first, as the file named them at start.
        self.predecessors = predecessors
        #: Episodes this process announced (`GroupStarted`), as written.
        self.announced = 0
        #: The numbers of the first and the last group it announced (-1: none yet).
        self.first_group = self.last_group = -1
        self._fd, self._offset = fd, offset

    @property
    def numbered_past(self) -> int:
        """The first group number past every group a predecessor announced (0: none did)."""
        return max((p.last_group + 1 for p in self.predecessors), default=0)

    @classmethod
    def open(cls, path: Path | None, incarnation: str) -> Lineage:
        """Read what `path` says of earlier processes, and rewrite it with this one at 0. None
        (a worker started by hand without a run directory): no file, no predecessors."""
        if path is None:
            return cls([], None, 0)
        # One that announced nothing has nothing to count: it must not push out one that did.
        predecessors = [p for p in read_lineage(path) if p.announced][-MAX_PREDECESSORS:]
        lines = [_line(p.incarnation, p.announced, p.first_group, p.last_group) for p in predecessors]
        offset = sum(len(line) for line in lines) + len(incarnation) + 1
        scratch = path.with_name(f"{path.name}.{os.getpid()}.new")
        scratch.write_bytes(b"".join([*lines, _line(incarnation, 0, -1, -1)]))
        os.replace(scratch, path)
        return cls(predecessors, os.open(path, os.O_WRONLY), offset)

    def announce(self, episodes: int, group: int) -> None:
        """`episodes` more announced (queued), of group number `group`: written before they run."""
        self.announced += episodes
        self.first_group = group if self.first_group < 0 else self.first_group
        self.last_group = group
        if self._fd is not None:
            os.pwrite(self._fd, _numbers(self.announced, self.first_group, self.last_group), self._offset)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def read_lineage(path: Path) -> list[Predecessor]:
    """The processes `path` names, oldest first; none when it is missing. A line that does not
    parse is skipped and said (the file is this project's own, so that is a bug or a hand)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return []
    found = []
    for line in data.splitlines():
        predecessor = _parse(line)
        if predecessor is None:
            log.warning(
                "%s: skipped a line that is not '<incarnation> <count> <first> <last>': %.80r",
                path,
                line,
            )
        else:
            found.append(predecessor)
    return found


def _parse(line: bytes) -> Predecessor | None:
    """A line, or None if it does not parse; the numbers are -1 (none) in the older layout."""
    incarnation, *fields = line.split(b" ")
    if not (incarnation.isalnum() and len(incarnation) <= 64 and len(fields) in (1, 3)):
        return None
    try:
        count, first, last = (int(f) for f in fields) if len(fields) == 3 else (int(fields[0]), -1, -1)
    except ValueError:
        return None
    numbered = len(fields) == 1 or (count > 0) == (first >= 0)  # a group announced has a number
    if not (numbered and 0 <= count <= MAX_COUNT and -1 <= first <= last <= MAX_COUNT):
        return None
    return Predecessor(incarnation.decode(), count, first, last)


def _line(incarnation: str, count: int, first: int, last: int) -> bytes:
    return incarnation.encode() + b" " + _numbers(count, first, last) + b"\n"


def _numbers(count: int, first: int, last: int) -> bytes:
    """Fixed width, so that a process rewrites its own in place (-1 fits: 20 characters too)."""
    return f"{count:0{_COUNT_DIGITS}d} {first:0{_COUNT_DIGITS}d} {last:0{_COUNT_DIGITS}d}".encode()
