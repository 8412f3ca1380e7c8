"""The actor's link to the learner: handshake, attach, weight updates. One implementation for
every actor kind.

    link = LearnerLink(channel, engine, describe)     # engine: a WeightEngine (below)
    if link.handles(message): link.dispatch(tg, peer, message)
    ... tokens are labelled with link.version ...

The learner drives three exchanges over the actor's ROUTER socket:

    Hello          -> ActorInfo        who are you (model, version, weight ranks, dtype)
    AttachLearner  -> ActorInfo        join my weight-broadcast group (a new one per session)
    WeightUpdate   -> WeightsApplied   a flat buffer of weights follows by broadcast

What differs between the vLLM engine and the synthetic one is only how the group is joined and
how the broadcast is received and loaded; that is a `WeightEngine`. The order, the session
check, the locking (attach and updates never overlap), the error replies and the version
bookkeeping are the same and live here once. With CURVE on (the default), attaches and updates
are taken only from a peer that authenticated with the learner's key (`Channel.peer_role`).

The version is adopted only after the engine has loaded the weights and resumed, so a token can
at worst be labelled one version too *old*, never too new: the learner's staleness bound stays
safe.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Protocol

import anyio
from anyio.abc import TaskGroup

from millstream.shared.protocol import (
    ActorInfo,
    AttachLearner,
    ErrorReply,
    Hello,
    Message,
    ReplyCause,
    WeightsApplied,
    WeightUpdate,
)
from millstream.shared.transport import Channel

__all__ = ["LearnerLink", "WeightEngine"]

log = logging.getLogger(__name__)


class WeightEngine(Protocol):
    """What an actor kind does for the learner link."""

    async def join(self, msg: AttachLearner) -> None:
        """Join the learner's broadcast group; raise on failure."""

    async def load(self, msg: WeightUpdate) -> None:
        """Receive the broadcast of `msg` and load it, generation paused meanwhile; raise on
        failure (generation must be running again either way)."""


class LearnerLink:
    """Serves Hello / AttachLearner / WeightUpdate for one actor; owns its policy version."""

    def __init__(self, channel: Channel, engine: WeightEngine, describe: Callable[[int], ActorInfo]) -> None:
        self.channel = channel
        self.engine = engine
        self._describe = describe
        #: Policy version of the weights the engine generates with now.
        self.version = 0
        #: The attached learner session ("" before the first attach).
        self.session = ""
        self.updates = 0
        self.last_update_paused_s = 0.0
        #: Attaches and updates refused because the peer was not the run's learner.
        self.refused_not_learner = 0
        #: Held by attach and updates; an actor kind may share it (the synthetic engine makes no
        #: token while weights are being received).
        self.lock = anyio.Lock()

    def info(self) -> ActorInfo:
        return self._describe(self.version)

    @staticmethod
    def handles(message: Message) -> bool:
        return isinstance(message, (Hello, AttachLearner, WeightUpdate))

    def dispatch(self, tg: TaskGroup, peer: bytes, message: Message) -> None:
        """Each exchange runs as a task: a full send queue or a slow group never blocks the
        caller's receive loop."""
        if isinstance(message, Hello):
            tg.start_soon(self._answer_hello, peer)
        elif not self._from_learner(peer):
            self.refused_not_learner += 1
            tg.start_soon(
                self._refuse,
                peer,
                ReplyCause.NOT_LEARNER,
                PermissionError(f"{type(message).__name__} is taken only from the run's learner key"),
            )
        elif isinstance(message, AttachLearner):
            tg.start_soon(self.attach, peer, message)
        elif isinstance(message, WeightUpdate):
            tg.start_soon(self.update, peer, message)

    def _from_learner(self, peer: bytes) -> bool:
        """With CURVE, only the learner's key may attach or push weights; without it (loopback
        opt-out) anyone who reaches the socket may."""
        return not self.channel.authenticated or self.channel.peer_role(peer) == "learner"

    async def _answer_hello(self, peer: bytes) -> None:
        await self.channel.send(self.info(), to=peer)  # waits for room in a full send queue

    async def attach(self, peer: bytes, msg: AttachLearner) -> None:
        async with self.lock:
            try:
                await self.engine.join(msg)
            except Exception as exc:
                log.exception("attaching learner session %s failed", msg.session)
                await self._refuse(peer, ReplyCause.ATTACH_FAILED, exc)
                return
            self.session = msg.session
            log.info("learner session %s attached", msg.session)
            await self.channel.send(self.info(), to=peer)

    async def update(self, peer: bytes, msg: WeightUpdate) -> None:
        async with self.lock:
            started = time.monotonic()
            try:
                if msg.session != self.session:
                    raise RuntimeError(f"session {msg.session!r} is not attached ({self.session!r} is)")
                await self.engine.load(msg)
            except Exception as exc:
                log.exception("weight update to version %d failed", msg.version)
                await self._refuse(peer, ReplyCause.WEIGHT_UPDATE_FAILED, exc)
                return
            self.version = msg.version
            paused = time.monotonic() - started
            self.updates += 1
            self.last_update_paused_s = paused
            log.info("now at policy version %d (paused %.3fs)", msg.version, paused)
            await self.channel.send(WeightsApplied(msg.version, paused), to=peer)

    async def _refuse(self, peer: bytes, cause: ReplyCause, exc: Exception) -> None:
        await self.channel.send(ErrorReply(cause, f"{type(exc).__name__}: {exc}"[:500]), to=peer)
