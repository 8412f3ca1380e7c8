"""The run's closing account: every episode any worker process started has exactly one fate.

    started (all worker processes, all learner sessions: learner/episodes/workers.py)
      == received (replay buffer, restored across sessions) - foreign (refused, never started)
    received == trained + dropped + failed + buffered (0 after the final drain)

A worker that died is covered by its `worker_lost` failures, synthesized when its successor said
hello. The results that reached a dead learner after its last checkpoint are pushed again by the
workers that kept them (envpool/redelivery.py); what no worker kept (past its bound, or a worker
that died too) is, after a restart (`resumed`), the difference between what the workers started
and what the restored learner received, counted as `learner_lost`. In a session that was not
resumed that difference must be 0: anything else is a bug, and `accounting_ok` says so.

Each worker's final `PoolDone` must also agree with the ledger about how many episodes its
process started.
"""

from __future__ import annotations

from typing import Any

from millstream.learner.episodes.workers import WorkerLedger
from millstream.learner.replay import ReplayBuffer
from millstream.shared.wire import Cause, PoolDone

__all__ = ["close_accounts", "worker_index"]


def worker_index(name: str) -> int:
    """'w3' -> 3 (an envpool worker's name); -1 for anything else."""
    return int(name[1:]) if name[:1] == "w" and name[1:].isdigit() else -1


def close_accounts(
    buffer: ReplayBuffer,
    ledger: WorkerLedger,
    done: dict[str, PoolDone],
    workers: int,
    resumed: bool,
    foreign: int = 0,
) -> dict[str, Any]:
    """Count what a dead learner lost, check every identity; the summary's accounting part.
    `foreign`: refused episodes no worker started (learner/episodes/intake.py), received but not the
    run's."""
    started = ledger.started_total
    unreceived = started - (buffer.statistics()["received"] - foreign)
    if resumed and unreceived > 0:
        buffer.count_unreceived(Cause.LEARNER_LOST, unreceived)
    stats = buffer.statistics()
    agreed = all(d.episodes_started == ledger.started_by_live(worker_index(n)) for n, d in done.items())
    accounted = stats["trained"] + sum(stats["dropped"].values()) + sum(stats["failed"].values())
    return {
        "workers_done": len(done),
        "episodes_started": started,
        "episodes_received": stats["received"],
        "episodes_foreign": foreign,
        "episodes_trained": stats["trained"],
        "episodes_dropped": stats["dropped"],
        "episodes_failed": stats["failed"],
        "episodes_refused": stats["refused"],
        "duplicates": stats["duplicates"],
        # Second copies of results a worker pushed again to a restarted learner (expected).
        "resent_duplicates": stats["resent_duplicates"],
        **ledger.statistics(),
        "accounting_ok": (
            len(done) == workers
            and agreed
            and started == stats["received"] - foreign
            and stats["received"] == accounted
        ),
    }
