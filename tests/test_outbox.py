"""The worker's outbox (envpool/outbox.py): one task sends everything for the learner in the
order it was queued, numbering results as it sends them, and keeps up with thousands of
episodes ending in one scheduler round.

The socket is replaced by a recording channel: these tests are about the order and the pace of
the one sending task; tests/test_redelivery.py and tests/test_healing.py use the real path.
"""

from __future__ import annotations

import anyio
import msgspec
import pytest

from millstream.envpool.outbox import Outbox
from millstream.envpool.redelivery import Unsettled
from millstream.shared.wire import (
    Cause,
    Codec,
    EpisodeFailed,
    GroupStarted,
    PolicyVersion,
    PoolDone,
    WorkerHello,
    group_id,
    member_id,
)

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend():
    return "trio"


class RecordingChannel:
    """What `Channel.send` was given, in order (decoded where it came encoded)."""

    def __init__(self) -> None:
        self.sent: list[object] = []
        self._codec = Codec()

    async def send(self, message, to: bytes = b"", timeout: float = 60.0) -> None:
        self.sent.append(self._codec.decode_one(message) if isinstance(message, msgspec.Raw) else message)


def failure(number: int, member: int) -> EpisodeFailed:
    gid = group_id(number)
    return EpisodeFailed(member_id(gid, member), gid, 2, Cause.ENV_ERROR, "")


async def test_results_are_numbered_in_the_order_they_are_sent_and_the_hello_counts_them():
    kept = Unsettled(0, "p", max_bytes=1 << 20)
    kept.hear(PolicyVersion(0, 0, session="s", settled=[]))  # the learner checkpoints: kept
    push = RecordingChannel()
    outbox = Outbox(push, kept, size=16)
    queued = [GroupStarted(0, "p", group_id(0), 2), failure(0, 0), failure(0, 1)]
    for message in queued:
        outbox.put_nowait(message)
    async with anyio.create_task_group() as tg:
        tg.start_soon(outbox.run)
        with anyio.fail_after(5):
            while len(push.sent) < 3:
                await anyio.sleep(0.001)
        # A new learner session whose checkpoint holds none of them: the two results again.
        again = await outbox.greet(PolicyVersion(0, 0, session="s2", settled=[]), lambda: WorkerHello(0, "p"))
        assert again == 2
        assert await outbox.close(PoolDone("w0", 2, 0, 2), timeout_s=5)
    assert push.sent[:3] == queued  # kept results went out in the encoding kept, unchanged
    assert [type(m).__name__ for m in push.sent[3:]] == ["Resent", "Resent", "WorkerHello", "PoolDone"]
    assert push.sent[5] == WorkerHello(0, "p", reported=2) and kept.pushed == 2


async def test_one_wake_up_sends_everything_queued_while_thousands_of_tasks_run():
    """2,000 results queued while 500 other tasks keep every scheduler round full: all of them
    are handed to the socket within two rounds of the test's own (one message a round fell
    behind at 10,000 live episodes and filled the outbox)."""
    push = RecordingChannel()
    outbox = Outbox(push, Unsettled(0, "p", max_bytes=0), size=4096)
    stop = anyio.Event()

    async def busy() -> None:
        while not stop.is_set():
            await anyio.lowlevel.checkpoint()

    async with anyio.create_task_group() as tg:
        for _ in range(500):
            tg.start_soon(busy)
        tg.start_soon(outbox.run)
        await anyio.lowlevel.checkpoint()
        for n in range(1000):
            outbox.put_nowait(failure(n, 0))
            outbox.put_nowait(failure(n, 1))
        await anyio.lowlevel.checkpoint()
        await anyio.lowlevel.checkpoint()
        sent = len(push.sent)
        stop.set()
        tg.cancel_scope.cancel()
    assert sent == 2000
    assert outbox.statistics()["queued"] == 0


async def test_put_with_room_takes_no_scheduler_round():
    """The admission loop queues one announcement a group: with room, `put` must not yield
    (a round each throttled admission at 1,000 live episodes: 9,000 -> 5,800 turns/s)."""
    outbox = Outbox(RecordingChannel(), Unsettled(0, "p", max_bytes=0), size=2048)
    rounds = 0

    async def count_rounds() -> None:
        nonlocal rounds
        while True:
            rounds += 1
            await anyio.lowlevel.checkpoint()

    async with anyio.create_task_group() as tg:
        tg.start_soon(count_rounds)
        await anyio.lowlevel.checkpoint()
        before = rounds
        for number in range(1000):
            await outbox.put(GroupStarted(0, "p", group_id(number), 2))
        assert rounds == before
        tg.cancel_scope.cancel()
