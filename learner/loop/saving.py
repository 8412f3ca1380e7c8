"""Rank 0's checkpoints and the journal between them: what a restart resumes from, and with.

`Saver.save` writes a checkpoint (learner/persist/checkpoint.py) and applies the policy for a
failed one: a full disk left `latest` at the last complete checkpoint, so training goes on and
tries again at the next interval, unless this was the final checkpoint or more than
`learner.max_failed_checkpoints` failed in a row (then the error stops the learner; a restart
resumes from `latest`).

Between checkpoints the journal (learner/persist/journal.py) keeps every accepted episode and
each step's version. `Saver.resume` loads a checkpoint and reads its journal back: the episodes
return to the intake as the greeting's backlog, written again into the new journal at once (a
second restart before the next checkpoint finds them too), and the abandoned timeline's last
version lets their tokens pass the version check where the loss corrects for the policy that
made them (`learner.staleness_policy = "decoupled"`: the behaviour logprobs are the
trajectory's own). With "drop" they are refused as before (`version`), counted, not lost.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from millstream.learner.episodes.intake import Intake
from millstream.learner.persist.checkpoint import CheckpointFailed, load_checkpoint, save_checkpoint
from millstream.learner.persist.journal import Journal, replay
from millstream.learner.replay import ReplayBuffer
from millstream.shared.config import Config

__all__ = ["Saver"]

log = logging.getLogger("learner")


class Saver:
    def __init__(
        self, cfg: Config, run_dir: Path, trainer: Any, buffer: ReplayBuffer, intake: Intake
    ) -> None:
        self.cfg, self.run_dir, self.trainer, self.buffer, self.intake = cfg, run_dir, trainer, buffer, intake
        self.failed_in_a_row = self.failed = 0
        self.journal: Journal | None = None
        self._replayed: set[str] = set()  # journaled again at the resume: not again at their release
        intake.on_accepted = self._journal_episode

    def open_journal(self) -> None:
        """Journal after the version the learner starts from (a fresh run's 0, a resumed one's)."""
        self.journal = Journal(self.run_dir, self.trainer.version)

    def load(self, path: Path) -> dict[str, Any]:
        """Load the checkpoint at `path` (the session is restored from its state next)."""
        return load_checkpoint(path, self.trainer, self.buffer)

    def replay_journal(self) -> None:
        """The loaded checkpoint's journal back into the intake, held for the greeting (all of
        it: what the dead learner had accepted, bounded by what it had taken since)."""
        found = replay(self.run_dir, self.trainer.version)
        self.journal = Journal(self.run_dir, self.trainer.version)  # the same file, begun again
        for message, sender in found.episodes:
            self.journal.episode(message, sender)
            self._replayed.add(message.episode_id)
        self.intake.held.extend(found.episodes)
        if found.last_version is not None:
            self.journal.step(found.last_version)
            if self.cfg.learner.staleness_policy == "decoupled":
                self.intake.timeline_end = found.last_version
        log.info(
            "journal after step %d: %d episodes taken again, the abandoned timeline reached version %s",
            self.trainer.version,
            len(found.episodes),
            found.last_version,
        )

    def _journal_episode(self, message: Any, sender: str | None) -> None:
        if self.journal is None:
            return
        if message.episode_id in self._replayed:
            self._replayed.discard(message.episode_id)
            return
        self.journal.episode(message, sender)

    def stepped(self, version: int) -> None:
        if self.journal is not None:
            self.journal.step(version)

    def save(self, extra: dict[str, Any], metrics: Any, final: bool = False) -> Path | None:
        """A checkpoint with `extra`; None if it failed and training may go on without it."""
        step = self.trainer.version
        try:
            path = save_checkpoint(
                self.run_dir, self.trainer, self.buffer, extra, keep=self.cfg.learner.keep_checkpoints
            )
        except CheckpointFailed as exc:
            self.failed_in_a_row, self.failed = self.failed_in_a_row + 1, self.failed + 1
            metrics.write({"event": "checkpoint_failed", "step": step, "error": str(exc)})
            allowed = self.cfg.learner.max_failed_checkpoints
            if final or self.failed_in_a_row > allowed:
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
        if self.journal is not None:
            self.journal.start(step)  # what the checkpoint holds needs no journal any more
        return path
