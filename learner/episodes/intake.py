"""What arrives on the learner's experience socket, each message inside its own error boundary.

An episode (`Trajectory` or `EpisodeFailed`) is checked (learner/episodes/validate.py), then buffered or
refused with a counted reason; a group announcement must name an admitted group of the run's
size; whatever else goes wrong with one message is counted (`bad_message`), and nothing a peer
sends ends the learner. The workers' bookkeeping
messages feed the ledger (learner/episodes/workers.py): `GroupStarted`, `WorkerHello` (whose dead
predecessor's unreported members come back as `worker_lost` failures, and what its lineage says
the dead announced unheard is counted so) and `PoolDone`.

Episodes that arrive while the learner still greets its workers (after a learner restart: the
results queued while it was down, and those the workers push again, `Resent`, because the
checkpoint lacks them: envpool/redelivery.py) are held until every worker said hello, because
only the hellos tell which groups the workers started; `release` then handles them. Their tokens
may come from the dead learner's later versions, a timeline this session abandoned:
`onto_this_timeline` relabels them so that their staleness is their distance to this session's
policy. The learner takes no step while it greets, so no held token is of this session's later
versions.

The intake also counts, per worker process, the results it took from that process after its
hello, in the order it pushed them (`WorkerLedger.credit`; the hello brings the count of what
came before): a checkpoint's counts tell each worker what it may forget.

Who may say what (with CURVE; `sender` is the key's identity, shared/wire/keys.py): worker i's
`WorkerHello`, `GroupStarted`, `PoolDone` and `EvalResult` only from worker i's key, and an
episode only from the key of the worker that started its group. A hello's lineage (what worker
i's dead processes announced) is taken on worker i's key's word, like its episodes: it can
misreport worker i's episodes only. Otherwise it is refused and
counted (`wrong_worker`, `not_a_worker`; an episode of a group no worker started,
`unstarted_group`), and a refused episode is foreign: it closes no slot. Without CURVE (a
loopback run that switched it off) every local process is trusted, as before.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from millstream.learner.episodes.validate import EpisodeCheck
from millstream.learner.episodes.workers import WorkerLedger
from millstream.learner.replay import ReplayBuffer
from millstream.learner.seen import number_of
from millstream.shared.config import Config
from millstream.shared.obs.ratelog import RateLog
from millstream.shared.wire import (
    Cause,
    EpisodeFailed,
    EvalResult,
    GroupStarted,
    Message,
    PoolDone,
    Resent,
    Trajectory,
    WorkerHello,
    group_number,
)
from millstream.shared.wire.keys import worker_of

__all__ = ["Intake", "held_bound"]

log = logging.getLogger("learner")


def held_bound(cfg: Config) -> int:
    """How many episodes a greeting may hold: what the workers run at once, and twice what may
    have reached a dead learner since its last checkpoint (the steps between checkpoints and the
    admission window past them), once as the backlog and once pushed again. Past the bound the
    greeting ends early, and a worker not greeted yet may see its results refused
    (`unannounced_group`: its numbering is not known yet)."""
    train = cfg.train
    steps = cfg.learner.checkpoint_every + train.max_staleness + 1 + cfg.envpool.admission_slack
    since_checkpoint = steps * train.groups_per_batch * train.group_size
    return cfg.envpool.max_concurrent_episodes * cfg.envpool.workers + 2 * since_checkpoint


@dataclass(frozen=True)
class _Origin:
    """Where an episode message comes from, as far as the intake's rules care."""

    #: Held through a greeting, or `Resent`: it may name a group the ledger does not know, and is
    #: not foreign for that.
    trusted: bool = False
    #: Held, from a worker that had said hello to this session when it arrived.
    after_hello: bool = False
    #: False for the learner's own `worker_lost` failures: no worker pushed them.
    pushed: bool = True


_HELD = _Origin(trusted=True)
_HELD_AFTER_HELLO = _Origin(trusted=True, after_hello=True)
_OWN = _Origin(pushed=False)


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
        #: Held results, their senders, where each came from (after its sender's hello?), and
        #: how many hellos its worker index had said when it was held.
        self.held: list[tuple[Trajectory | EpisodeFailed, str | None, _Origin, int]] = []
        #: Hellos taken per worker index this session: a held result that came after one hello
        #: is covered by the next one's `reported` (a hello queued for a dead session and the
        #: hello for this one both arrive while greeting), so it is not counted again.
        self.hellos: dict[int, int] = {}
        #: Refused episodes that no worker announced (forged, or a bug upstream): the buffer
        #: counts them as received, the accounting leaves them out of the run's episodes.
        self.foreign = 0
        self.max_held = held_bound(cfg)
        #: Group numbers from here on belong to worker (number % workers) (learner/loop/session.py
        #: aligned_base); None while this session's base is not settled and earlier sessions'
        #: numbering is unknown (a checkpoint from before the rule, or another worker count).
        self.aligned_from: int | None = 0
        #: The policy version this session resumed at (None: not resumed).
        self.resumed_at: int | None = None
        #: Trajectories taken with versions relabeled (`onto_this_timeline`).
        self.relabeled = 0

    def take(
        self, message: Message, sender: str | None, *, version: int, admitted: int, greeting: bool
    ) -> None:
        """One message: held while `greeting` (episodes only, up to a bound), else handled."""
        if (
            greeting
            and isinstance(message, (Trajectory, EpisodeFailed, Resent))
            and len(self.held) < self.max_held
        ):
            index = self._index(message, sender)
            hellos = -1 if index is None else self.hellos.get(index, 0)
            if isinstance(message, Resent):
                self.held.append((message.result, sender, _HELD, hellos))
            else:
                greeted = index in self.ledger.greeted
                self.held.append((message, sender, _HELD_AFTER_HELLO if greeted else _HELD, hellos))
        else:
            self.handle(message, sender, version=version, admitted=admitted)

    def release(self, *, version: int, admitted: int) -> None:
        """Handle the held episodes (the greeting is over, or the run ends)."""
        held, self.held = self.held, []
        for result, sender, origin, hellos in held:  # results of a restart's backlog: not foreign
            index = self._index(result, sender)
            if origin.after_hello and index is not None and self.hellos.get(index, 0) != hellos:
                origin = _HELD  # a later hello's `reported` counted it
            self._episode(result, sender, version, admitted, origin)

    def onto_this_timeline(self, traj: Trajectory) -> Trajectory:
        """A trajectory with versions past the one this session resumed at (C) has tokens of the
        dead learner's policies C+1, C+2, ...: a branch this session abandoned. Version v becomes
        2C - v, so staleness (the policy's version minus the token's) is the distance from that
        policy to this session's along the tree, and the staleness bound decides (a label below
        -1 is such a distance too: only generated tokens' versions are read). Asked of held and
        resent trajectories, of any with a version past the learner's own, and of any of a
        group admitted before this session (numbered below the buffer's floor), which may have
        been played partly on the dead learner's weights after this session reached the same
        version numbers: a version alone cannot tell the two apart, and this errs on the stale
        side (`_episode`)."""
        base = self.resumed_at
        if base is None or max(traj.versions, default=-1) <= base:
            return traj
        return msgspec.structs.replace(
            traj, versions=[2 * base - v if v > base else v for v in traj.versions]
        )

    def handle(self, message: Message, sender: str | None, *, version: int, admitted: int) -> None:
        """One message, refused and counted rather than raised whatever it holds."""
        try:
            self._dispatch(message, sender, version, admitted)
        except Exception as exc:  # a bug of ours or a message no check foresaw: the learner goes on
            kind = type(message).__name__
            self.refusals.event("bad_message", "could not take a %s: %r", kind, exc)

    @property
    def workers(self) -> int:
        """The run's envpool worker count (the ledger's, the one source of it)."""
        return self.ledger.workers

    def sent_by_its_worker(self, message: Message, sender: str | None) -> bool:
        """Whether worker-named bookkeeping came with that worker's key (always without CURVE);
        if not, the refusal is counted (`wrong_worker`)."""
        if sender is None:
            return True
        if isinstance(message, (WorkerHello, GroupStarted)):
            claimed = f"worker index {message.index}"
            ok = worker_of(sender) == message.index
        elif isinstance(message, (PoolDone, EvalResult)):
            claimed = f"worker {message.worker!r}"
            ok = worker_of(sender) is not None and message.worker == f"w{worker_of(sender)}"
        else:
            return True
        if not ok:
            self.refusals.event(
                "wrong_worker",
                "refused %s for %s sent with key %.20r",
                type(message).__name__,
                claimed,
                sender,
            )
        return ok

    def _dispatch(self, message: Message, sender: str | None, version: int, admitted: int) -> None:
        if isinstance(message, (Trajectory, EpisodeFailed)):
            self._episode(message, sender, version, admitted)
        elif isinstance(message, Resent):
            self._episode(message.result, sender, version, admitted, _HELD)
        elif not self.sent_by_its_worker(message, sender):
            return
        elif isinstance(message, PoolDone):
            self.done_workers[message.worker] = message
        elif isinstance(message, GroupStarted):
            problem = self._group_problem(message, admitted)
            if problem is None:
                lost, counted = self.ledger.group_started(message)
                if counted:  # a dead process's, late: its lineage's id-less count, now by id
                    self.buffer.count_unreceived(Cause.WORKER_LOST, -counted)
                for failure in lost:
                    self._episode(failure, None, version, admitted, _OWN)
            else:
                self.refusals.event(
                    "bad_group_started", "refused GroupStarted %.40r: %s", message.group_id, problem
                )
        elif isinstance(message, WorkerHello):
            if not 0 <= message.index < self.ledger.workers:
                self.refusals.event("bad_hello", "refused WorkerHello of worker index %d", message.index)
                return
            index = message.index
            if self.ledger.is_retired(index, message.incarnation):  # behind its successor's
                self.refusals.event(
                    "retired_hello", "refused the hello of a dead process of worker %d", index
                )
                return
            self.hellos[index] = self.hellos.get(index, 0) + 1
            lost, unheard = self.ledger.hello(message, lambda gid: self._number_owner(gid) in (None, index))
            if lost or unheard:
                log.warning(
                    "envpool worker %d: %d episodes of its dead processes lost (%d known only from "
                    "their lineage file)",
                    message.index,
                    len(lost) + unheard,
                    unheard,
                )
            for failure in lost:  # the learner's own: no sender to check, no worker pushed it
                self._episode(failure, None, version, admitted, _OWN)
            if unheard:  # no ids: counted, as a dead learner's unreceived ones are
                self.buffer.count_unreceived(Cause.WORKER_LOST, unheard)
        else:
            self.refusals.event(
                "unexpected", "unexpected %s on the experience socket", type(message).__name__
            )

    def _number_owner(self, group_id: str) -> int | None:
        """The worker whose numbers include this group's, where numbering says (else None)."""
        try:
            number = group_number(group_id)
        except ValueError:
            return None
        aligned = self.aligned_from is not None and number >= self.aligned_from
        return number % self.workers if aligned else None

    def _index(self, message: Trajectory | EpisodeFailed | Resent, sender: str | None) -> int | None:
        """The worker index that sent `message`: its key's, or (without CURVE) its group's."""
        gid = message.result.group_id if isinstance(message, Resent) else message.group_id
        return worker_of(sender) if sender is not None else self._number_owner(gid)

    def _pusher(
        self, message: Trajectory | EpisodeFailed, sender: str | None, origin: _Origin
    ) -> tuple[int, str] | None:
        """The worker process (index, incarnation) whose count `message` goes to once taken:
        the process that started its open group, once it said hello to this session. None for
        what came before that hello (the backlog of a restart, resent or not): the hello's own
        count covers it (`WorkerLedger.hello`)."""
        index = self._index(message, sender)
        if not origin.pushed or index is None or index not in self.ledger.greeted:
            return None
        if origin.trusted and not origin.after_hello:
            return None
        started = self.ledger.reporter(message.group_id)
        return started if started is not None and started[0] == index else None

    def _received_unknown(self, message: Trajectory | EpisodeFailed, sender: str | None) -> None:
        """One of the run's results, of a group the ledger does not know, was received: if a
        dead process's lineage had counted it lost without an id, it is not lost."""
        index = self._index(message, sender)
        if index is not None and self.ledger.received_unknown(index, message.group_id):
            self.buffer.count_unreceived(Cause.WORKER_LOST, -1)

    def _group_problem(self, message: GroupStarted, admitted: int) -> str | None:
        """What is wrong with a group announcement, or None. Only admitted numbers of the
        worker's own, the run's group size and a known worker index: an announcement may not
        open its own admission, nor take another worker's group, nor start one twice."""
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
        if (owner := self._number_owner(message.group_id)) not in (None, message.index):
            return f"group {number} is worker {owner}'s, not worker {message.index}'s"
        if (started := self.ledger.owner(message.group_id)) is not None:
            return f"group {number} was started already, by worker {started}"
        return None

    def _reporter_problem(
        self, message: Trajectory | EpisodeFailed, sender: str | None, trusted: bool
    ) -> tuple[str, str] | None:
        """(reason, detail) when `sender` may not report this episode, or None (see the module
        docstring). An episode held during the greeting (`trusted`), or sent before its worker's
        hello (the backlog of a learner restart), may name a group the ledger does not know."""
        if sender is None:
            return None
        index = worker_of(sender)
        if index is None:
            return "not_a_worker", f"sent with key {sender[:20]!r}, not a worker's"
        started = self.ledger.owner(message.group_id)
        owner = started if started is not None else self._number_owner(message.group_id)
        if owner is not None and owner != index:
            return (
                "wrong_worker",
                f"group {message.group_id[:40]!r} is worker {owner}'s; sent with worker {index}'s key",
            )
        if started is None and not (trusted or index not in self.ledger.greeted):
            return "unstarted_group", f"no worker started group {message.group_id[:40]!r}"
        return None

    def _episode(
        self,
        message: Trajectory | EpisodeFailed,
        sender: str | None,
        version: int,
        admitted: int,
        origin: _Origin = _Origin(),
    ) -> None:
        trusted, relabeled = origin.trusted, False
        if isinstance(message, Trajectory) and (
            trusted
            or max(message.versions, default=-1) > version  # the dead learner's
            or number_of(message.group_id) < self.buffer.floor  # may hold the dead learner's
        ):
            moved = self.onto_this_timeline(message)
            relabeled, message = moved is not message, moved
        found = self.check.problem(message, version=version, admitted=admitted, relabeled=relabeled)
        # Who sent it decides whether it is the run's (a refused forgery must not be remembered
        # as a member's, or the member's own report would be a duplicate); the reason said is
        # the group's own first when it cannot exist (never admitted, a bad id).
        reporter = self._reporter_problem(message, sender, trusted)
        expected = reporter is None and (trusted or self.ledger.expects(message.episode_id, message.group_id))
        if found is not None and not found.closes_slot:
            reporter = None
        cause = str(message.cause) if isinstance(message, EpisodeFailed) else ""
        before = self.buffer.failed.get(cause, 0)
        if reporter is not None:  # closes no slot: it was not this sender's to close
            refusal: tuple[str, bool] | None = (reporter[0], False)
        else:
            refusal = None if found is None else (found.reason, found.closes_slot)
        # Whose result it is, asked before `reported` may close its group; counted for that
        # process if the buffer took it (not a duplicate) as one of the run's, from its sender.
        process = self._pusher(message, sender, origin) if expected else None
        unknown_group = self.ledger.owner(message.group_id) is None
        received = self.buffer.received
        reason = self.buffer.accept(message, refusal, remember=expected, resent=trusted)
        if self.buffer.received > received:
            self.relabeled += relabeled
            if process is not None:
                self.ledger.credit(process)
            # One of the run's (not foreign) that a worker pushed (not the learner's own
            # failures for a closed group).
            if unknown_group and origin.pushed and (reason is None or expected):
                self._received_unknown(message, sender)
        closes = reporter is None and found is not None and found.closes_slot
        if reason is None or closes:
            self.ledger.reported(message.episode_id, message.group_id)  # its slot is closed
        if reason is not None:
            if not expected:  # no worker started it: counted, but not one of the run's episodes
                self.foreign += 1
            if reporter is not None:
                detail = reporter[1]
            else:
                detail = found.detail if found is not None else "disagrees with its group or the buffer"
            self.refusals.event(reason, "refused episode %.40r: %s: %s", message.episode_id, reason, detail)
        elif isinstance(message, EpisodeFailed) and self.buffer.failed.get(cause, 0) > before:
            self.record_failed(message, version)
