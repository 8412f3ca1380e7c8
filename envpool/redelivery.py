"""What a worker keeps of the results it pushed, until a learner checkpoint holds them.

    kept = Unsettled(index, incarnation, max_bytes=64 << 20)
    kept.keep(result)                         # every Trajectory / EpisodeFailed, as pushed
    kept.hear(version)                        # every PolicyVersion: forget what its `settled` holds
    for resent in kept.unsaved(version): ...  # a new learner session: push again what it lacks

A learner that dies loses the results that reached it after its last checkpoint: it restarts
from that checkpoint, and the results were nowhere else. The worker that pushed them still can
have them, so it keeps each one until the learner says a checkpoint holds it. The learner counts
the results each worker process pushed as they arrive (learner/episodes/workers.py), saves the
counts in every checkpoint and announces the latest saved ones in `PolicyVersion.settled`.
One PUSH connection delivers a process's results in the order it sent them, so "the first n
results" is the whole statement: the worker numbers its pushes and forgets those below n.

When a new learner session appears, the worker pushes again the results past the count the new
session restored, each wrapped in `Resent`, before its hello; the learner holds them with the
rest of the backlog of a restart and judges them after every hello (learner/episodes/intake.py).
A result that was in flight anyway (queued in ZeroMQ while the learner was down) arrives twice;
the second copy is counted as a resent duplicate, which costs nothing.

The hello says how many results the process pushed before it (`WorkerHello.reported`): all of
them are on its connection ahead of the hello, pushed again where a dead learner had them, and
the learner takes no step until every hello came, so the next checkpoint holds them all; the
learner counts the ones after the hello as it takes them, in the order they were pushed.

Kept results are stored encoded (msgpack is about a sixth of the Python objects' size), and the
channel sends that encoding as it is, so a result is encoded once. They are bounded by bytes;
past the bound the oldest go (`evicted`), and a learner that dies before a checkpoint holds
them counts them as `learner_lost`, as before this existed. A learner that saves no checkpoints
(`learner.checkpoint_every = 0`) announces `settled = None`: nothing could be restored, so
nothing is kept.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterator

import msgspec

from millstream.shared.wire import Codec, EpisodeFailed, PolicyVersion, Resent, Trajectory

__all__ = ["Unsettled"]

log = logging.getLogger("envpool")


class Unsettled:
    """The pushed results of worker `index`'s process `incarnation`, numbered 0, 1, ..., kept
    from the oldest a checkpoint lacks."""

    def __init__(self, index: int, incarnation: str, max_bytes: int) -> None:
        self.index, self.incarnation = index, incarnation
        self.max_bytes = max_bytes
        self._codec = Codec()
        self._kept: deque[tuple[int, msgspec.Raw]] = deque()
        #: Results this process pushed (the next one's number).
        self.pushed = 0
        #: Whether the learner checkpoints (its last `PolicyVersion.settled` was not None).
        self.active = False
        self.bytes = 0
        self.evicted = 0
        self.redelivered = 0

    def keep(self, result: Trajectory | EpisodeFailed) -> msgspec.Raw | None:
        """Number a pushed result, and keep it while the learner checkpoints. Returns it
        encoded when kept, for the channel to send as it is (one encoding, not two)."""
        number = self.pushed
        self.pushed += 1
        if not self.active or self.max_bytes <= 0:
            return None
        encoded = self._codec.encode_one(result)
        self._kept.append((number, encoded))
        self.bytes += len(encoded)
        while self.bytes > self.max_bytes and self._kept:
            self._forget()
            self.evicted += 1
            if self.evicted % 1000 == 1:  # the first, then every thousandth
                log.warning(
                    "%d pushed results were forgotten before a checkpoint held them: a learner "
                    "death now loses them (envpool.redeliver_mib = %.0f)",
                    self.evicted,
                    self.max_bytes / 2**20,
                )
        return encoded  # sent even when the bound evicted it at once

    def saved(self, version: PolicyVersion) -> int:
        """How many of this process's results the learner's latest checkpoint holds (0: none,
        or the checkpoint is older than this process)."""
        for entry in version.settled or ():
            if (entry.index, entry.incarnation) == (self.index, self.incarnation):
                return entry.reports
        return 0

    def hear(self, version: PolicyVersion) -> None:
        """Keep while the learner checkpoints; forget what its latest checkpoint holds."""
        self.active = version.settled is not None
        self.forget_saved(self.saved(version))

    def forget_saved(self, reports: int) -> None:
        """A checkpoint holds this process's first `reports` results: forget them."""
        while self._kept and self._kept[0][0] < reports:
            self._forget()

    def unsaved(self, first: PolicyVersion) -> Iterator[Resent]:
        """What a new learner session, whose `first` version says what its checkpoint holds,
        lacks: decoded one at a time (all at once they would take several times the bound)."""
        self.forget_saved(self.saved(first))
        for _, encoded in list(self._kept):
            message = self._codec.decode_one(encoded)
            if isinstance(message, (Trajectory, EpisodeFailed)):
                self.redelivered += 1
                yield Resent(self.incarnation, message)

    def _forget(self) -> None:
        _, encoded = self._kept.popleft()
        self.bytes -= len(encoded)

    def statistics(self) -> dict[str, int]:
        return {
            "pushed": self.pushed,
            "kept": len(self._kept),
            "kept_bytes": self.bytes,
            "evicted": self.evicted,
            "redelivered": self.redelivered,
        }
