"""Counted, rate-limited logging of bad input.

A hostile or broken peer can send bad frames as fast as the network allows. Logging each one
(the old behaviour) wrote 1.4-1.7 MB per 10,000 bad frames: the log becomes the attack. So every
bad-input event is *counted* under a key (the reason), the first `first` of each key are logged
in full (the sample a reader needs to see what went wrong), and after that at most one line per
`every_s` seconds per key says how many were suppressed meanwhile. The counts are kept for
statistics (`counts`), so nothing is lost even when a line is.

    bad = RateLog(log)
    bad.event("malformed_frame", "dropped a bad frame from %s: %s", peer, exc)

Single-threaded use only (each role's receive loop owns its RateLog); it does no I/O of its own
beyond the logger.
"""

from __future__ import annotations

import logging
import time
from collections import Counter

__all__ = ["RateLog"]


class RateLog:
    """Counts events per key; logs a sample of each key and then one summary line per interval."""

    def __init__(
        self, logger: logging.Logger, *, first: int = 10, every_s: float = 10.0, level: int = logging.WARNING
    ) -> None:
        self.logger = logger
        self.first = first
        self.every_s = every_s
        self.level = level
        #: Every event ever seen, per key.
        self.counts: Counter[str] = Counter()
        self._suppressed: Counter[str] = Counter()
        self._next_line: dict[str, float] = {}

    def event(self, key: str, message: str, *args: object) -> bool:
        """Count one event under `key`; log it if the key is still in its sample or its interval
        has passed (then with the number suppressed since the last line). True if logged."""
        self.counts[key] += 1
        if self.counts[key] <= self.first:
            self.logger.log(self.level, message, *args)
            return True
        now = time.monotonic()
        if now < self._next_line.get(key, 0.0):
            self._suppressed[key] += 1
            return False
        self._next_line[key] = now + self.every_s
        skipped, self._suppressed[key] = self._suppressed[key], 0
        self.logger.log(
            self.level,
            message + " (%d like it so far; %d not logged since the last line)",
            *args,
            self.counts[key],
            skipped,
        )
        return True

    def total(self) -> int:
        return sum(self.counts.values())
