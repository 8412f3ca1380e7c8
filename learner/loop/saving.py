"""Rank 0's checkpoints, what a failed one means for the run, and the journal between them.

`Saver.save` writes a checkpoint (learner/persist/checkpoint.py). One that failed for the disk
(full, over quota, read-only, an I/O error: `disk_trouble`) left `latest` at the last complete
checkpoint, so training goes on and tries again at the next interval, unless this was the final
checkpoint or more than `learner.max_failed_checkpoints` failed in a row: then the error stops
the learner (a restart resumes from `latest`). Any other failure (a bug, out of memory) stops
it at once, with its traceback: carrying on past an unknown error would hide it.

Between checkpoints the journal (learner/persist/journal.py) keeps what the intake took, the
admission limits announced and the steps' versions. `replay_journal`, after a resume, gives
the intake those messages again in their order, before the greeting, with the admission limit
the dead session had reached. Tokens of the abandoned timeline (versions past the checkpoint's
N, made by weights no process has any more) are relabelled at their distance from the new
timeline: version v becomes 2N - v, so a group's staleness at version c is (c - N) + (v - N),
the steps between the two policies, and the staleness bound (`train.max_staleness`, or
`learner.decoupled_max_staleness`) keeps or drops it as it would any group that old; the
behaviour logprobs are the trajectory's own either way.
"""

from __future__ import annotations

import errno
import logging
import secrets
from pathlib import Path
from typing import Any

import msgspec

from millstream.learner.episodes.intake import Intake
from millstream.learner.episodes.workers import WorkerLedger
from millstream.learner.loop.session import Session
from millstream.learner.persist.checkpoint import CheckpointFailed, load_checkpoint, save_checkpoint
from millstream.learner.persist.journal import Journal, read_journal
from millstream.learner.replay import ReplayBuffer
from millstream.shared.config import Config
from millstream.shared.wire import Message, Trajectory

__all__ = ["Saver", "disk_trouble", "relabelled"]

log = logging.getLogger("learner")

_DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS})
# What the writers that raise no OSError say when the disk refused their bytes: torch's
# (RuntimeError "... file write failed"), safetensors' (SafetensorError "... StorageFull ...").
_DISK_WORDS = (
    "file write failed",
    "No space left",
    "Disk quota exceeded",
    "StorageFull",
    "Read-only file system",
)


def disk_trouble(exc: BaseException) -> bool:
    """Whether `exc`, or an error it was raised from, is the disk's (see the module docstring)."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in _DISK_ERRNOS:
            return True
        if not isinstance(seen, CheckpointFailed) and any(w in str(seen) for w in _DISK_WORDS):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def relabelled(message: Message, fork: int) -> Message:
    """`message` with its abandoned-timeline token versions (> `fork`) at their distance from
    the new timeline (see the module docstring); anything else as it is."""
    if not isinstance(message, Trajectory) or max(message.versions, default=-1) <= fork:
        return message
    versions = [v if v <= fork else max(0, 2 * fork - v) for v in message.versions]
    return msgspec.structs.replace(message, versions=versions)


class Saver:
    def __init__(
        self, cfg: Config, run_dir: Path, trainer: Any, buffer: ReplayBuffer, intake: Intake
    ) -> None:
        self.cfg, self.run_dir, self.trainer, self.buffer = cfg, run_dir, trainer, buffer
        self.failed_in_a_row = self.failed = 0
        self.journal = Journal(run_dir)
        self._nonce = ""  # of the checkpoint the journal follows
        intake.on_taken = self.journal.message

    def load(self, path: Path) -> dict[str, Any]:
        """Load the checkpoint at `path` (the session is restored from its state next)."""
        state = load_checkpoint(path, self.trainer, self.buffer)
        self._nonce = str(state.get("journal", ""))
        return state

    def replay_journal(self, intake: Intake, session: Session, ledger: WorkerLedger) -> None:
        """After `load` and the session's restore: the loaded checkpoint's journal back into the
        intake, then into a journal of its own (a second restart finds it too)."""
        fork = self.trainer.version
        found = read_journal(self.run_dir, fork, self._nonce)
        admitted = max(session.admitted, found.admitted)
        for message, sender, held in found.messages:
            intake.replay(relabelled(message, fork), sender, held, version=fork, admitted=admitted)
        ledger.greeted.clear()  # the dead session's hellos: this one's greeting starts afresh
        session.admitted = admitted  # no group at or above it started; some below it did
        if self._nonce and self.cfg.learner.checkpoint_every:
            self.journal.start(fork, self._nonce, found.records)
        log.info(
            "journal after step %d: %d messages taken again (%d left out), the abandoned timeline reached %s",
            fork,
            len(found.messages),
            found.skipped,
            found.last_version,
        )

    def admitted(self, limit: int) -> None:
        self.journal.admitted(limit)

    def stepped(self, version: int) -> None:
        self.journal.step(version)

    def close(self) -> None:
        self.journal.close()

    def save(self, extra: dict[str, Any], metrics: Any, final: bool = False) -> Path | None:
        """A checkpoint with `extra`; None if it failed and training may go on without it."""
        step = self.trainer.version
        keep = self.cfg.learner.keep_checkpoints
        nonce = secrets.token_hex(8)  # ties the journal that follows to this checkpoint only
        try:
            path = save_checkpoint(
                self.run_dir, self.trainer, self.buffer, {**extra, "journal": nonce}, keep=keep
            )
        except CheckpointFailed as exc:
            self.failed_in_a_row, self.failed = self.failed_in_a_row + 1, self.failed + 1
            metrics.write({"event": "checkpoint_failed", "step": step, "error": str(exc)})
            allowed = self.cfg.learner.max_failed_checkpoints
            if final or self.failed_in_a_row > allowed or not disk_trouble(exc):
                raise
            log.error(
                "%s; training goes on (%d failed in a row, the run stops after %d)",
                exc,
                self.failed_in_a_row,
                allowed,
            )
            return None
        self.failed_in_a_row = 0
        metrics.write({"event": "checkpoint", "step": step, "path": str(path)})
        if self.cfg.learner.checkpoint_every and not final:
            try:
                self.journal.start(step, nonce)  # what the checkpoint holds needs no journal
                self._nonce = nonce
            except OSError as exc:  # the disk again: no journal until the next checkpoint
                self.journal.close()
                log.error("journal after step %d not started: %s", step, exc)
        return path
