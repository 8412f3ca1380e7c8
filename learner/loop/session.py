"""Where one learner session stands in the run, and what a checkpoint carries of it.

A session is one learner process. A learner that dies and is restarted from its latest
checkpoint is a new session of the same run: it gets a new id (the envpool workers say hello to
each session), counts itself (`count`), and continues the group numbering where the saved
session left it, so no group number is used twice.

A checkpoint holds the policy and the replay buffer (learner/persist/checkpoint.py) and, beside
them, the `extra` this module writes and reads: the next group number, the worker ledger
(learner/episodes/workers.py), the highest admission limit announced, the number of sessions,
the count of foreign episodes, and where the run's records stood (a resume marks every record
after these positions rolled back: shared/store/rundir.py). The state is plain containers, so
the followers' ranks can be sent it as is (`Team.command("save", extra)`).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from millstream.learner.episodes.intake import Intake
from millstream.learner.episodes.workers import WorkerLedger
from millstream.learner.replay import ReplayBuffer

__all__ = ["Session", "session_state", "restore_session", "next_group"]


@dataclass
class Session:
    """This learner process's numbering and admission marks."""

    #: This learner process; a restarted learner is a new session, and workers say hello to it.
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    #: Learner sessions of this run, this one included (resumes add).
    count: int = 1
    #: First group number of this session (continues after a resume).
    group_base: int = 0
    #: Groups admitted and trained in this session (>= group_base).
    trained_groups: int = 0
    #: Highest admission limit announced: no group at or above it started.
    admitted: int = 0


def aligned_base(number: int, workers: int) -> int:
    """The first multiple of `workers` at or after `number`: a session's group_base. Worker i
    numbers group_base + i, + workers, ... (envpool/gate.py), so with every base a multiple,
    worker i's groups are the numbers = i (mod workers) in every session, and the learner can
    tell whose a group is from its number (learner/episodes/intake.py)."""
    return -(-number // workers) * workers


def next_group(session: Session, buffer: ReplayBuffer) -> int:
    """The first group number a resumed session may use: after every group this one numbered
    and every group the buffer has seen."""
    seen = buffer.max_group_number()
    return max(session.group_base, (-1 if seen is None else seen) + 1)


def session_state(
    session: Session,
    run_dir: Path,
    buffer: ReplayBuffer,
    ledger: WorkerLedger,
    intake: Intake,
    records: dict[str, int],
) -> dict[str, Any]:
    """The checkpoint's `extra` for this session; `records` is where each record file stands."""
    return {
        "next_group": next_group(session, buffer),
        "run_dir": str(run_dir),
        "records": records,
        "ledger": ledger.state_dict(),
        "admitted": session.admitted,
        "sessions": session.count,
        "foreign": intake.foreign,
        "aligned_workers": intake.workers,  # every base of this run was aligned to this count
        "refusals": dict(intake.refusals.counts),
        "relabeled": intake.relabeled,
    }


def restore_session(session: Session, state: dict[str, Any], ledger: WorkerLedger, intake: Intake) -> None:
    """Continue from a checkpoint's state (as `load_checkpoint` returns it): this session
    numbers after the saved one and counts one session more."""
    session.group_base = aligned_base(int(state["next_group"]), intake.workers)
    if "ledger" in state:
        ledger.load_state_dict(state["ledger"])
        session.admitted = int(state["admitted"])
        session.count = int(state["sessions"]) + 1
        intake.foreign = int(state["foreign"])
        intake.refusals.counts.update(state.get("refusals", {}))
        intake.relabeled = int(state.get("relabeled", 0))
    # Earlier sessions' numbers follow the rule only if they were aligned to this worker count
    # (a checkpoint from before the rule, or one with another count: this session's only).
    intake.aligned_from = 0 if state.get("aligned_workers") == intake.workers else None
    ledger.rebase(session.group_base)
