"""Rank 0's checkpoints, and what a failed one means for the run.

`Saver.save` writes a checkpoint (learner/persist/checkpoint.py). One that failed for the disk
(full, over quota, read-only, an I/O error: `disk_trouble`) left `latest` at the last complete
checkpoint, so training goes on and tries again at the next interval, unless this was the final
checkpoint or more than `learner.max_failed_checkpoints` failed in a row: then the error stops
the learner (a restart resumes from `latest`). Any other failure (a bug, out of memory) stops
it at once, with its traceback: carrying on past an unknown error would hide it.
"""

from __future__ import annotations

import errno
import logging
from pathlib import Path
from typing import Any

from millstream.learner.persist.checkpoint import CheckpointFailed, load_checkpoint, save_checkpoint
from millstream.learner.replay import ReplayBuffer
from millstream.shared.config import Config

__all__ = ["Saver", "disk_trouble"]

log = logging.getLogger("learner")

_DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS})
# What the writers that raise no OSError say when the disk refused their bytes: torch's
# (RuntimeError "... file write failed"), safetensors' (SafetensorError "... StorageFull ...").
_DISK_WORDS = (
    "file write failed",
    "unexpected pos",  # torch's writer on a full disk (its context: "iostream error")
    "iostream error",
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


class Saver:
    def __init__(self, cfg: Config, run_dir: Path, trainer: Any, buffer: ReplayBuffer) -> None:
        self.cfg, self.run_dir, self.trainer, self.buffer = cfg, run_dir, trainer, buffer
        self.failed_in_a_row = self.failed = 0

    def load(self, path: Path) -> dict[str, Any]:
        """Load the checkpoint at `path` (the session is restored from its state next)."""
        return load_checkpoint(path, self.trainer, self.buffer)

    def save(self, extra: dict[str, Any], metrics: Any, final: bool = False) -> Path | None:
        """A checkpoint with `extra`; None if it failed and training may go on without it."""
        step = self.trainer.version
        keep = self.cfg.learner.keep_checkpoints
        try:
            path = save_checkpoint(self.run_dir, self.trainer, self.buffer, extra, keep=keep)
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
        return path
