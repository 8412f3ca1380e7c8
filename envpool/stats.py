"""What a worker counts: episodes started, finished and failed by cause, and its own memory.

The counts are the worker's side of the run's accounting (the learner keeps the other side);
`actor_failure_streak` is how a worker notices an actor that fails every episode, and stops
instead of burning them (`ActorUnavailable`, envpool/worker.py). The worker writes these with the
client's, the gate's and the sockets' statistics to `envpool-<name>.jsonl` every
`envpool.stats_every_s`.
"""

from __future__ import annotations

import os
import resource
from collections import Counter
from dataclasses import dataclass, field

from millstream.shared.wire import ACTOR_CAUSES, Cause, EpisodeFailed, Trajectory

__all__ = ["WorkerStats", "rss_bytes"]


@dataclass
class WorkerStats:
    started: int = 0
    finished: int = 0
    failed: Counter[Cause] = field(default_factory=Counter)
    live: int = 0
    groups: int = 0
    #: Episodes failed in a row by the actor's fault; reset by any other outcome.
    actor_failure_streak: int = 0

    def settle(self, result: Trajectory | EpisodeFailed) -> None:
        """Count one episode's end."""
        self.live -= 1
        if isinstance(result, Trajectory):
            self.finished += 1
            self.actor_failure_streak = 0
        else:
            self.failed[result.cause] += 1
            actor_fault = result.cause in ACTOR_CAUSES
            self.actor_failure_streak = self.actor_failure_streak + 1 if actor_fault else 0


def rss_bytes(pid: int | str = "self") -> int:
    """Resident memory of a process now (Linux /proc; this one by default), or, for this
    process, its peak where /proc is missing."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        if pid != "self":
            raise
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
