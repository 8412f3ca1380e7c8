"""What arrives on the learner's experience socket, each message inside its own error boundary.

An episode (`Trajectory` or `EpisodeFailed`) is checked (learner/episodes/validate.py), then buffered or
refused with a counted reason; a group announcement must name an admitted group of the run's
size; whatever else goes wrong with one message is counted (`bad_message`), and nothing a peer
sends ends the learner. The workers' bookkeeping
messages feed the ledger (learner/episodes/workers.py): `GroupStarted`, `WorkerHello` (whose dead
predecessor's unreported members come back as `worker_lost` failures) and `PoolDone`.

Episodes that arrive while the learner still greets its workers (after a learner restart: the
results queued while it was down) are held until every worker said hello, because only the
hellos tell which groups the workers started; `release` then handles them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from millstream.learner.episodes.validate import EpisodeCheck
from millstream.learner.episodes.workers import WorkerLedger
from millstream.learner.replay import ReplayBuffer
from millstream.shared.config import Config
from millstream.shared.obs.ratelog import RateLog
from millstream.shared.wire import (
    EpisodeFailed,
    GroupStarted,
    Message,
    PoolDone,
    Trajectory,
    WorkerHello,
    group_number,
)

__all__ = ["Intake"]

log = logging.getLogger("learner")


class Intake:
    def __init__(
        self,
        cfg: Config,
        buffer: ReplayBuffer,
        ledger: WorkerLedger,
        check: EpisodeCheck,
        record_failed: Callable[[EpisodeFailed, int], None],
    ) -> None:
        self.buffer, self.ledger, self.check = buffer, ledger, check
        self.record_failed = record_failed
        self.refusals = RateLog(log)  # a peer decides how many: counted, a sample logged
        self.done_workers: dict[str, PoolDone] = {}
        self.held: list[Trajectory | EpisodeFailed] = []
        #: Refused episodes that no worker announced (forged, or a bug upstream): the buffer
        #: counts them as received, the accounting leaves them out of the run's episodes.
        self.foreign = 0
        self.max_held = cfg.envpool.max_concurrent_episodes * cfg.envpool.workers

    def take(self, message: Message, *, version: int, admitted: int, greeting: bool) -> None:
        """One message: held while `greeting` (episodes only, up to a bound), else handled."""
        if greeting and isinstance(message, (Trajectory, EpisodeFailed)) and len(self.held) < self.max_held:
            self.held.append(message)
        else:
            self.handle(message, version=version, admitted=admitted)

    def release(self, *, version: int, admitted: int) -> None:
        """Handle the held episodes (the greeting is over, or the run ends)."""
        held, self.held = self.held, []
        for message in held:  # the workers' results from before their hellos: theirs, not foreign
            self._episode(message, version, admitted, trusted=True)

    def handle(self, message: Message, *, version: int, admitted: int) -> None:
        """One message, refused and counted rather than raised whatever it holds."""
        try:
            self._dispatch(message, version, admitted)
        except Exception as exc:  # a bug of ours or a message no check foresaw: the learner goes on
            kind = type(message).__name__
            self.refusals.event("bad_message", "could not take a %s: %r", kind, exc)

    def _dispatch(self, message: Message, version: int, admitted: int) -> None:
        if isinstance(message, (Trajectory, EpisodeFailed)):
            self._episode(message, version, admitted)
        elif isinstance(message, PoolDone):
            self.done_workers[message.worker] = message
        elif isinstance(message, GroupStarted):
            problem = self._group_problem(message, admitted)
            if problem is None:
                self.ledger.group_started(message)
            else:
                self.refusals.event(
                    "bad_group_started", "refused GroupStarted %.40r: %s", message.group_id, problem
                )
        elif isinstance(message, WorkerHello):
            if not 0 <= message.index < self.ledger.workers:
                self.refusals.event("bad_hello", "refused WorkerHello of worker index %d", message.index)
                return
            lost = self.ledger.hello(message)
            if lost:
                log.warning("envpool worker %d restarted: %d episodes lost with it", message.index, len(lost))
            for failure in lost:
                self._episode(failure, version, admitted)
        else:
            self.refusals.event(
                "unexpected", "unexpected %s on the experience socket", type(message).__name__
            )

    def _group_problem(self, message: GroupStarted, admitted: int) -> str | None:
        """What is wrong with a group announcement, or None. Only admitted numbers, the run's
        group size and a known worker index: an announcement may not open its own admission."""
        try:
            number = group_number(message.group_id)
        except ValueError as exc:
            return str(exc)
        if number >= admitted:
            return f"group {number} was never admitted (limit {admitted})"
        if message.group_size != self.ledger.group_size:
            return f"group_size {message.group_size}, the run's is {self.ledger.group_size}"
        if not 0 <= message.index < self.ledger.workers:
            return f"worker index {message.index} outside [0, {self.ledger.workers})"
        return None

    def _episode(
        self, message: Trajectory | EpisodeFailed, version: int, admitted: int, trusted: bool = False
    ) -> None:
        expected = trusted or self.ledger.expects(message.episode_id, message.group_id)
        found = self.check.problem(message, version=version, admitted=admitted)
        cause = str(message.cause) if isinstance(message, EpisodeFailed) else ""
        before = self.buffer.failed.get(cause, 0)
        refusal = None if found is None else (found.reason, found.closes_slot)
        reason = self.buffer.accept(message, refusal, remember=expected)
        if reason is None or (found is not None and found.closes_slot):
            self.ledger.reported(message.episode_id, message.group_id)  # its slot is closed
        if reason is not None:
            if not expected:  # no worker started it: counted, but not one of the run's episodes
                self.foreign += 1
            detail = found.detail if found is not None else "disagrees with its group or the buffer"
            self.refusals.event(reason, "refused episode %.40r: %s: %s", message.episode_id, reason, detail)
        elif isinstance(message, EpisodeFailed) and self.buffer.failed.get(cause, 0) > before:
            self.record_failed(message, version)
