"""The learner's hold on the actor across actor restarts: push weights, notice a new actor
process, bring it up to the current policy.

When the launcher restarts a dead actor (`run.max_restarts`), the new process starts from the
model's initial weights at policy version 0 and knows no learner session. The learner notices in
one of two ways:
- the actor's pid file in the run directory changed (the launcher rewrites it on every start),
  checked once per loop iteration; or
- a weight push failed (the broadcast group lost its peer, or the new actor refused an update
  for a session it does not know).
Either way it drops the old link (a fresh socket, so nothing the old session left queued is read
as an answer), then keeps training and announcing while it waits, without blocking, for the new
actor to answer a `Hello`; then it attaches again and pushes the current weights. Tokens the new
actor generated before that carry version 0 and the staleness bound drops them, counted.

Without restarts (`run.max_restarts = 0`, or an actor the launcher did not start) a failed push
is an error, as before.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from .weights import WeightSender, WeightSyncError

__all__ = ["ActorLink"]

log = logging.getLogger("learner")

Weights = Callable[[], Iterable[tuple[str, torch.Tensor]]]

#: A Hello left unanswered this long is sent again on a fresh socket.
HELLO_EVERY_S = 5.0


class ActorLink:
    def __init__(self, sync: WeightSender, pid_file: Path | None) -> None:
        self.sync = sync
        #: Set when the launcher supervises the actor and may restart it.
        self.pid_file = pid_file
        self._pid = self._read_pid()
        #: True between losing the actor and catching the new one up.
        self.down = False
        self.restarts_seen = 0
        self._asked = 0.0  # when the current Hello was sent

    def push(self, weights: Weights, version: int) -> dict[str, float]:
        """Push `version`; {} if the actor is down (it gets the weights once it is back)."""
        if self.down:
            return {}
        try:
            return self.sync.push(weights(), version)
        except (WeightSyncError, RuntimeError) as exc:  # RuntimeError: the broadcast's peer died
            if self.pid_file is None:
                raise
            log.warning("weight push of version %d failed (%s): waiting for the actor", version, exc)
            self._lose()
            return {}

    def follow(self, weights: Weights, version: int) -> bool:
        """Once per loop iteration: notice a restarted actor, catch a ready one up. True when the
        actor was just brought to `version`."""
        pid = self._read_pid()
        if pid != self._pid:  # a new actor process, even one that replaced a replacement
            self._pid = pid
            log.warning("the actor restarted (pid %s): re-attaching once it answers", pid)
            self._lose()
        if not self.down:
            return False
        if time.monotonic() - self._asked > HELLO_EVERY_S:  # the Hello may have gone to a dead one
            self.sync.reconnect()
            self._asked = time.monotonic()
        if not self.sync.answers_hello():
            return False
        try:
            self.sync.attach()
            self.sync.push(weights(), version)
        except (WeightSyncError, RuntimeError) as exc:  # it died again, or is not ready yet
            log.warning("re-attaching the actor failed (%s); trying again", exc)
            self._lose()
            return False
        self.down = False
        log.info("the restarted actor is attached and at policy version %d", version)
        return True

    def _lose(self) -> None:
        self.down = True
        self.restarts_seen += 1
        self.sync.reconnect()
        self._asked = time.monotonic()

    def _read_pid(self) -> str | None:
        if self.pid_file is None:
            return None
        try:
            return self.pid_file.read_text().strip()
        except OSError:
            return None
