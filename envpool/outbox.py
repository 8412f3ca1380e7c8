"""Everything a worker tells the learner, in one order: the order results are numbered in.

    outbox = Outbox(push_channel, kept)      # kept: envpool/redelivery.py's Unsettled
    tg.start_soon(outbox.run)                # the one task that sends
    outbox.put_nowait(result)                # an episode's end (never waits while there is room)
    await outbox.put(GroupStarted(...))      # bookkeeping, in the same line
    await outbox.greet(first_version, hello) # a new learner session: push again, then hello()
    await outbox.close(pool_done)            # the last message, sent before this returns

Why one task: the learner counts a process's results in the order they arrive, and the worker
forgets the first n of them when a checkpoint holds n (envpool/redelivery.py). That needs the
number a result gets to be its place on the wire. Episodes that end while the socket's queue is
full each wait, and waiting tasks resume in whatever order the scheduler picks, so numbering
results as each episode ends could disagree with the order they were sent. Here the one sending
task numbers each result as it hands it to the socket, and fills in the hello's `reported` the
same way: every result counted there is ahead of the hello on the wire.
"""

from __future__ import annotations

from collections.abc import Callable

import anyio
import msgspec

from millstream.envpool.redelivery import Unsettled
from millstream.shared.wire import EpisodeFailed, Message, Outgoing, PolicyVersion, Trajectory, WorkerHello
from millstream.shared.wire.transport import Channel

__all__ = ["Outbox"]


class Outbox:
    """The worker's messages to the learner's experience socket, sent in order by `run`."""

    def __init__(self, push: Channel, kept: Unsettled, size: int) -> None:
        self.push, self.kept = push, kept
        self._tx, self._rx = anyio.create_memory_object_stream[Message](size)
        self._sent_last = anyio.Event()

    def put_nowait(self, message: Message) -> None:
        """Queue without waiting; raises anyio.WouldBlock when the outbox is full."""
        self._tx.send_nowait(message)

    async def put(self, message: Message, timeout_s: float = 60.0) -> None:
        """Queue, waiting at most `timeout_s` for room (TimeoutError past it).

        With room, no scheduler round and no cancel scope: the admission loop queues a
        `GroupStarted` per group, and a round each (a stream's `send` always yields) made
        admitting thousands of groups wait thousands of rounds (9,000 -> 5,800 turns/s at 1,000
        live, 2026-11-28)."""
        try:
            self._tx.send_nowait(message)
            return
        except anyio.WouldBlock:
            pass
        with anyio.fail_after(timeout_s):
            await self._tx.send(message)

    async def greet(self, first: PolicyVersion, hello: Callable[[], WorkerHello]) -> int:
        """A new learner session: what its checkpoint lacks, pushed again, then `hello()`, made
        after them (what runs then) and with `reported` filled in as it is sent. Returns how
        many results went again."""
        again = 0
        for resent in self.kept.unsaved(first):
            await self._tx.send(resent)
            again += 1
        await self._tx.send(hello())
        return again

    async def close(self, last: Message, timeout_s: float) -> bool:
        """Queue `last`, and wait (at most `timeout_s`) until it was handed to the socket."""
        await self._tx.send(last)
        self._tx.close()
        with anyio.move_on_after(timeout_s):
            await self._sent_last.wait()
        return self._sent_last.is_set()

    async def run(self) -> None:
        """Number each result as it is handed to the socket, and send everything in order.

        Each wake-up sends everything queued, not one message: a receive from the stream is a
        scheduler round, and with 10,000 episodes runnable in a round, one message a round
        fell behind the episodes that ended in it (the outbox filled and held every episode
        that ended, 2026-11-28: 10,064 queued, 40 MB).

        The receiving end stays open when this task is cancelled (the worker stopping): an
        episode cancelled with it still queues its result instead of failing on a closed
        stream."""
        ended = False
        while not ended:
            try:
                message = await self._rx.receive()
            except anyio.EndOfStream:
                break
            await self._send(message)
            ended = await self._drain()
        self._sent_last.set()

    async def _drain(self) -> bool:
        """Send what is queued, without a scheduler round each; True when the stream ended."""
        while True:
            try:
                message = self._rx.receive_nowait()
            except anyio.WouldBlock:
                return False
            except anyio.EndOfStream:
                return True
            await self._send(message)

    async def _send(self, message: Message) -> None:
        outgoing: Outgoing = message
        if isinstance(message, (Trajectory, EpisodeFailed)):
            encoded = self.kept.keep(message)  # kept encoded: sent as it is
            outgoing = message if encoded is None else encoded
        elif isinstance(message, WorkerHello):
            outgoing = msgspec.structs.replace(message, reported=self.kept.pushed)
        await self.push.send(outgoing)

    def statistics(self) -> dict[str, int]:
        stats = self._rx.statistics()
        return {"queued": stats.current_buffer_used, "queue_max": int(stats.max_buffer_size)}
