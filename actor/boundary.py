"""The actor's error boundary per message: whatever one message does, it is served, refused or
counted, and the actor keeps serving.

Three rules, shared by the vLLM actor, the synthetic one and the learner link:

- **A frame carries at most `actor.max_messages_per_frame` messages.** The envpool packs at most
  `transport.coalesce_max` into one; a frame of 70,000 small messages is not a client, and every
  message past the bound is refused with one `ErrorReply(too_many_messages)` for the frame.
- **Replies never wait.** A reply is queued with `send_nowait`; when the send queue is full it is
  dropped and counted (`reply_dropped`). Waiting would let a peer that floods us and reads
  nothing stall the receive loop, and raising (`anyio.WouldBlock`) out of a task group ended the
  actor. A client whose reply was dropped sees a timeout, which it already handles.
- **A task started for one message never ends the actor.** `guarded` catches what the task
  raises (a send that timed out, a bug), counts it (`task_error`) and logs a sample. Only the
  engine's death stops the actor, through its own watch.

Refusals that answer no particular request (unexpected messages, an oversized frame, a busy
link) are answered at most once per peer and reason per frame: one bad frame costs one reply,
not thousands. Every refusal is counted by reason in `refused` and logged through a `RateLog`.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

import anyio

from millstream.shared.obs.ratelog import RateLog
from millstream.shared.wire import ErrorReply, Message, ReplyCause
from millstream.shared.wire.transport import Channel

__all__ = ["Boundary"]

log = logging.getLogger(__name__)


class Boundary:
    """Bounds, refuses and counts on behalf of one actor's ROUTER channel."""

    def __init__(self, channel: Channel, max_messages_per_frame: int = 4096) -> None:
        self.channel = channel
        self.max_messages_per_frame = max_messages_per_frame
        #: Refusals and drops by reason (`too_many_messages`, `reply_dropped`, `task_error`, ...).
        self.refused: Counter[str] = Counter()
        self.bad = RateLog(log)
        self._said: set[tuple[bytes, str]] = set()  # (peer, reason) answered in this frame

    def frame(self, peer: bytes, messages: list[Message]) -> list[Message]:
        """The messages of one frame this actor will serve; refuses the rest."""
        self._said.clear()
        limit = self.max_messages_per_frame
        if len(messages) <= limit:
            return messages
        extra = len(messages) - limit
        self.refused[str(ReplyCause.TOO_MANY_MESSAGES)] += extra - 1  # `refuse` counts one more
        self.refuse_once(
            peer,
            ErrorReply(
                ReplyCause.TOO_MANY_MESSAGES,
                f"a frame of {len(messages)} messages; the actor serves at most {limit} "
                f"(actor.max_messages_per_frame) and refused the last {extra}",
            ),
        )
        return messages[:limit]

    def refuse(self, peer: bytes, reason: str, reply: Message, detail: str = "") -> None:
        """Count a refusal under `reason`, log a sample, and answer `reply` if there is room."""
        self.refused[reason] += 1
        self.bad.event(reason, "refused a message from peer %s: %s %s", peer.hex()[:16], reason, detail)
        self.reply(peer, reply)

    def refuse_once(self, peer: bytes, reply: ErrorReply) -> None:
        """`refuse` with an `ErrorReply`, answered once per peer and cause in this frame."""
        reason = str(reply.cause)
        if (peer, reason) in self._said:
            self.refused[reason] += 1
            return
        self._said.add((peer, reason))
        self.refuse(peer, reason, reply, reply.message)

    def reply(self, peer: bytes, message: Message) -> bool:
        """Queue `message` for `peer` without waiting; a full queue drops it (counted)."""
        try:
            self.channel.send_nowait(message, to=peer)
            return True
        except anyio.WouldBlock:
            self.refused["reply_dropped"] += 1
            self.bad.event("reply_dropped", "send queue full: dropped a %s", type(message).__name__)
            return False

    async def guarded(self, task: Callable[..., Awaitable[Any]], *args: Any) -> None:
        """Run `task(*args)`; what it raises is counted and logged, never propagated."""
        try:
            await task(*args)
        except Exception as exc:
            self.refused["task_error"] += 1
            self.bad.event("task_error", "a task for one message failed: %s: %s", type(exc).__name__, exc)

    def statistics(self) -> dict[str, int]:
        return dict(self.refused)
