"""One live request of the actor client: the generation its deltas fill in, and its waiter.

The client (envpool/actors/client.py) keeps one `PendingRequest` per request in flight, by
request id. Its reply router adds each delta's tokens as it arrives and ends the request (a
final delta, a failure, its deadline); the episode waits once, for the end.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import anyio
import sniffio
import trio

from millstream.envpool.actors.generation import Generation, GenerationFailed, Sampling
from millstream.shared.wire import Cause

__all__ = ["PendingRequest"]


class PendingRequest:
    """One live request: the generation its deltas fill in, how it ended, and its waiter.

    The reply router appends each delta's tokens here as it arrives and wakes the episode once,
    when the request ends (a final delta, a failure, its deadline): an episode needs the whole
    generation, and one wake-up per turn instead of one per delta matters at 10,000 live
    requests. Memory is bounded by the request's own `max_tokens` (more fails it).
    """

    __slots__ = ("out", "max_tokens", "timeout_s", "sent_at", "failure", "finished", "timed_out", "wake")

    def __init__(self, request_id: str, sampling: Sampling, sent_at: float) -> None:
        self.out = Generation(request_id=request_id)
        self.max_tokens, self.timeout_s = sampling.max_tokens, sampling.timeout_s
        self.sent_at = sent_at
        self.failure: GenerationFailed | None = None
        self.finished = False
        self.timed_out = False
        self.wake: Callable[[], object] | None = None  # wakes the waiting episode, once

    def end(self) -> None:
        self.finished = True
        if self.wake is not None:
            wake, self.wake = self.wake, None
            wake()

    def fail(self, failure: GenerationFailed) -> None:
        if not self.finished:
            self.failure = failure
            self.end()

    async def wait(self) -> None:
        """Until the request ends. On trio the task parks itself (trio's low-level API): an
        anyio Event is three objects and a parking lot per wait, about 700 bytes and the
        most of a waiting episode's memory after its own frames, at 10,000 live requests."""
        if self.finished:
            return
        if sniffio.current_async_library() != "trio":
            event = anyio.Event()
            self.wake = event.set
            await event.wait()
            return
        self.wake = partial(trio.lowlevel.reschedule, trio.lowlevel.current_task())
        await trio.lowlevel.wait_task_rescheduled(self._abort)

    def _abort(self, _: object) -> trio.lowlevel.Abort:
        self.wake = None  # cancelled: nothing may reschedule the task any more
        return trio.lowlevel.Abort.SUCCEEDED

    def time_out(self) -> None:
        """Its deadline passed (called by the client's `Deadlines`)."""
        if not self.finished:
            self.timed_out = True
            self.fail(GenerationFailed(Cause.ACTOR_TIMEOUT, f"no final delta within {self.timeout_s}s"))
