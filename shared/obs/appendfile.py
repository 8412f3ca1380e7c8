"""A file of lines that outlives a full disk: the metrics and the episode log append to it.

A run's disk can fill while it trains (its own checkpoints, the store, someone else's files).
A record that cannot be written is then lost, counted and logged at a bounded rate; the run goes
on, and the lines already written stay as they were. Written with `os.write` on an O_APPEND
descriptor, one call per line and no buffer between: a buffered file would keep a failed line
and write it, or half of it, later, in the middle of another. A line cut short by the disk is
ended with a newline before the next one, so a reader (`read_jsonl`) skips one torn line and
reads every other.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from millstream.shared.obs.ratelog import RateLog

__all__ = ["AppendFile"]

log = logging.getLogger(__name__)


class AppendFile:
    """Lines appended to `path` (created if missing); `write` never raises for the disk."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
        #: Lines not written (or cut short) because the disk refused them.
        self.lost = 0
        # A writer killed mid-line left it torn: end it before the first line of this one.
        self._torn = self.position() > 0 and self._last_byte() != b"\n"
        self._errors = RateLog(log)

    def _last_byte(self) -> bytes:
        with self.path.open("rb") as f:
            f.seek(-1, os.SEEK_END)
            return f.read(1)

    def write(self, line: bytes) -> bool:
        """Append one line (it ends with a newline); False if the disk took none or part of it."""
        data = b"\n" + line if self._torn else line  # end a line a full disk cut short
        try:
            written = os.write(self._fd, data)
        except OSError as exc:
            self._lost(exc.strerror or str(exc))
            return False
        if written < len(data):  # the disk filled mid-line: the next line ends it
            self._torn = True
            self._lost("short write")
            return False
        self._torn = False
        return True

    def _lost(self, why: str) -> None:
        self.lost += 1
        self._errors.event("write_failed", "%s: line not written (%s); %d so far", self.path, why, self.lost)

    def position(self) -> int:
        """Bytes in the file now (every line is written when `write` returns)."""
        return os.fstat(self._fd).st_size

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
