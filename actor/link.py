"""The actor's link to the learner: handshake, attach, weight updates. One implementation for
every actor kind.

    link = LearnerLink(channel, engine, describe)     # engine: a WeightEngine (below)
    if link.handles(message): link.dispatch(tg, peer, message)
    ... tokens are labelled with link.version ...

The learner drives three exchanges over the actor's ROUTER socket:

    Hello          -> ActorInfo        who are you (model, version, weight ranks, dtype)
    AttachLearner  -> ActorInfo        join my weight-broadcast group (a new one per session)
    WeightUpdate   -> WeightsApplied   a flat buffer of weights follows by broadcast, in pieces
    DigestWeights  -> WeightsDigest    sums over the weights the engine holds (a check)

What differs between the vLLM engine and the synthetic one is only how the group is joined and
how the broadcast is received and loaded; that is a `WeightEngine`. The order, the session
check, the locking (attach and updates never overlap), the error replies and the version
bookkeeping are the same and live here once. An update has two steps: `receive` while the
engine generates, then `load` with generation paused (the `swap` lock, which an engine's
generation may share); `WeightsApplied` reports the two times apart. With CURVE on (the
default), attaches and updates are taken only from a peer that authenticated with the learner's
key (`Channel.peer_role`).

Every exchange is inside the actor's error boundary (`actor/boundary.py`): replies never wait,
a failing exchange is counted, and at most `MAX_EXCHANGES` run at once (more are refused `busy`).
An attach first checks, in a thread and without the lock, that the learner's store is up and
marked for its session (`shared.wire.weightsync.await_session`); only then does the engine join, so
an `AttachLearner` naming a closed port or a silent store never pauses generation. A failed
attach leaves the session that was attached before it in place.

The version is adopted only after the engine has loaded the weights and resumed, so a token can
at worst be labelled one version too *old*, never too new: the learner's staleness bound stays
safe.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

import anyio
from anyio.abc import TaskGroup

from millstream.actor.boundary import Boundary
from millstream.shared.wire import (
    ActorInfo,
    AttachLearner,
    DigestWeights,
    ErrorReply,
    Hello,
    Message,
    ReplyCause,
    WeightsApplied,
    WeightsDigest,
    WeightUpdate,
)
from millstream.shared.wire.transport import Channel
from millstream.shared.wire.weightsync import await_session, session_tag

__all__ = ["LearnerLink", "WeightEngine"]

log = logging.getLogger(__name__)


class WeightEngine(Protocol):
    """What an actor kind does for the learner link."""

    async def join(self, msg: AttachLearner) -> None:
        """Join the learner's broadcast group; raise on failure."""

    async def receive(self, msg: WeightUpdate) -> None:
        """Receive the broadcast of `msg`, generation going on meanwhile; raise on failure."""

    async def load(self, msg: WeightUpdate) -> None:
        """Load what `receive` got, generation paused meanwhile; raise on failure (generation
        must be running again either way)."""

    async def digest(self) -> tuple[float, float, int]:
        """Sum, sum of magnitudes and count of the weights the engine holds."""


class LearnerLink:
    """Serves Hello / AttachLearner / WeightUpdate for one actor; owns its policy version."""

    #: Attach and update exchanges running at once; the learner runs one at a time.
    MAX_EXCHANGES = 4

    def __init__(
        self,
        channel: Channel,
        engine: WeightEngine,
        describe: Callable[[int], ActorInfo],
        boundary: Boundary | None = None,
        tokens: Callable[[], int] = lambda: 0,
    ) -> None:
        self.channel = channel
        self.engine = engine
        self.boundary = boundary or Boundary(channel)
        self._exchanges = 0
        # Threads that wait for a learner's store; bounded so attaches cannot take every thread.
        self._checks = anyio.CapacityLimiter(self.MAX_EXCHANGES)
        self._describe = describe
        self._tokens = tokens
        #: Policy version of the weights the engine generates with now.
        self.version = 0
        #: The attached learner session ("" before the first attach).
        self.session = ""
        self.updates = 0
        self.last_update_paused_s = 0.0
        #: Attaches and updates refused because the peer was not the run's learner.
        self.refused_not_learner = 0
        #: A frozen actor (the judge) refuses attaches and updates: its weights never change.
        self.frozen = False
        #: Held by attaches, updates and digests: one at a time.
        self.lock = anyio.Lock()
        #: Held while an update's weights are loaded; an actor kind may share it (the synthetic
        #: engine makes no token meanwhile).
        self.swap = anyio.Lock()

    def info(self) -> ActorInfo:
        return self._describe(self.version)

    @staticmethod
    def handles(message: Message) -> bool:
        return isinstance(message, (Hello, AttachLearner, WeightUpdate, DigestWeights))

    def dispatch(self, tg: TaskGroup, peer: bytes, message: Message) -> None:
        """Hello is answered at once; attach and updates run as tasks (a slow group never blocks
        the caller's receive loop), at most `MAX_EXCHANGES` of them."""
        if isinstance(message, Hello):
            self.boundary.reply(peer, self.info())
            return
        if not self._from_learner(peer):
            self.refused_not_learner += 1
            self.boundary.refuse_once(
                peer,
                ErrorReply(
                    ReplyCause.NOT_LEARNER,
                    f"{type(message).__name__} is taken only from the run's learner key",
                ),
            )
            return
        if self.frozen and isinstance(message, (AttachLearner, WeightUpdate)):
            self.boundary.refuse_once(
                peer, ErrorReply(ReplyCause.FROZEN, "this actor serves a frozen model and takes no weights")
            )
            return
        if self._exchanges >= self.MAX_EXCHANGES:
            self.boundary.refuse_once(
                peer, ErrorReply(ReplyCause.BUSY, f"{self._exchanges} learner exchanges already running")
            )
            return
        tasks: dict[type, Callable[..., Any]] = {
            AttachLearner: self.attach,
            WeightUpdate: self.update,
            DigestWeights: self.digest,
        }
        task = tasks[type(message)]
        self._exchanges += 1  # counted now: a frame of many must not pass the check above
        tg.start_soon(self._exchange, task, peer, message)

    def _from_learner(self, peer: bytes) -> bool:
        """With CURVE, only the learner's key may attach or push weights; without it (loopback
        opt-out) anyone who reaches the socket may."""
        return not self.channel.authenticated or self.channel.peer_role(peer) == "learner"

    async def _exchange(self, task: Callable[..., Any], peer: bytes, message: Message) -> None:
        try:
            await self.boundary.guarded(task, peer, message)
        finally:
            self._exchanges -= 1

    async def attach(self, peer: bytes, msg: AttachLearner) -> None:
        try:  # before the lock: the engine keeps generating while this waits
            await anyio.to_thread.run_sync(
                await_session, msg.host, msg.port, msg.session, msg.timeout_s, limiter=self._checks
            )
        except Exception as exc:  # the session attached before stays attached
            await self._refuse(peer, ReplyCause.ATTACH_FAILED, exc)
            return
        async with self.lock:
            try:
                await self.engine.join(msg)
            except Exception as exc:
                log.exception("attaching learner %s failed", session_tag(msg.session))
                await self._refuse(peer, ReplyCause.ATTACH_FAILED, exc)
                return
            self.session = msg.session
            log.info("learner %s attached", session_tag(msg.session))
            self.boundary.reply(peer, self.info())

    async def update(self, peer: bytes, msg: WeightUpdate) -> None:
        async with self.lock:
            started = time.monotonic()
            if msg.session != self.session:  # a stranger's update: refused, counted, no traceback
                problem = RuntimeError(
                    f"{session_tag(msg.session)} is not attached ({session_tag(self.session)} is)"
                )
                await self._refuse(peer, ReplyCause.WEIGHT_UPDATE_FAILED, problem)
                return
            try:
                await self.engine.receive(msg)
                received = time.monotonic()
                async with self.swap:
                    await self.engine.load(msg)
            except Exception as exc:
                log.exception("weight update to version %d failed", msg.version)
                await self._refuse(peer, ReplyCause.WEIGHT_UPDATE_FAILED, exc)
                return
            self.version = msg.version
            paused = time.monotonic() - received
            self.updates += 1
            self.last_update_paused_s = paused
            log.info(
                "now at policy version %d (received in %.3fs, paused %.3fs)",
                msg.version,
                received - started,
                paused,
            )
            reply = WeightsApplied(msg.version, paused, self._tokens(), receive_s=received - started)
            self.boundary.reply(peer, reply)

    async def digest(self, peer: bytes, msg: DigestWeights) -> None:
        async with self.lock:  # never in the middle of a load
            total, abs_total, numel = await self.engine.digest()
            self.boundary.reply(peer, WeightsDigest(self.version, total, abs_total, numel))

    async def _refuse(self, peer: bytes, cause: ReplyCause, exc: Exception) -> None:
        reply = ErrorReply(cause, f"{type(exc).__name__}: {exc}"[:500])
        self.boundary.refuse(peer, str(cause), reply, reply.message)
