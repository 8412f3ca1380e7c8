"""How many episodes each process of a worker index announced, in a file that outlives it.

    lineage = Lineage.open(run_dir / "envpool-w0.lineage", incarnation)
    lineage.predecessors        # the dead processes of this index, read at start (for the hello)
    lineage.announce(8)         # each group: queued its GroupStarted, now count it, then run it

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

Where the file is: the run directory, which a Ray launch keeps on a filesystem every node
shares (shared/launch/ray). A successor on another node finds it too; a node that died may not
have written its last counts there, and then its announcements are counted as they were before
this file existed (what the learner heard). A resumed run (`run.resume` of a run directory)
reads the previous launch's files: what its processes announced after the checkpoint is
counted `worker_lost` in the resumed run's accounts (it ended with that launch).

The file is a few fixed-width lines, `<incarnation> <count>`, the newest last. Each process
rewrites it whole once at start (the last `MAX_PREDECESSORS` predecessors that announced
anything, and itself, through a rename) and then overwrites only its own count in place: one
`pwrite` of 20 bytes per group, to the page cache. A process killed mid-write leaves the count
it had (a 20-byte write within one page is not torn by a process death).
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
        self._fd, self._offset = fd, offset

    @classmethod
    def open(cls, path: Path | None, incarnation: str) -> Lineage:
        """Read what `path` says of earlier processes, and rewrite it with this one at 0. None
        (a worker started by hand without a run directory): no file, no predecessors."""
        if path is None:
            return cls([], None, 0)
        # One that announced nothing has nothing to count: it must not push out one that did.
        predecessors = [p for p in read_lineage(path) if p.announced][-MAX_PREDECESSORS:]
        lines = [_line(p.incarnation, p.announced) for p in predecessors]
        offset = sum(len(line) for line in lines) + len(incarnation) + 1
        scratch = path.with_name(f"{path.name}.{os.getpid()}.new")
        scratch.write_bytes(b"".join([*lines, _line(incarnation, 0)]))
        os.replace(scratch, path)
        return cls(predecessors, os.open(path, os.O_WRONLY), offset)

    def announce(self, episodes: int) -> None:
        """`episodes` more announced (queued): written before they run."""
        self.announced += episodes
        if self._fd is not None:
            os.pwrite(self._fd, f"{self.announced:0{_COUNT_DIGITS}d}".encode(), self._offset)

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
        incarnation, _, count = line.partition(b" ")
        if incarnation.isalnum() and len(incarnation) <= 64 and count.isdigit() and int(count) <= MAX_COUNT:
            found.append(Predecessor(incarnation.decode(), int(count)))
        else:
            log.warning("%s: skipped a line that is not '<incarnation> <count>': %.80r", path, line)
    return found


def _line(incarnation: str, count: int) -> bytes:
    return f"{incarnation} {count:0{_COUNT_DIGITS}d}\n".encode()
