"""The worker's collector policy (envpool/heap.py): full collections on a timer, and undone."""

from __future__ import annotations

import gc
import weakref

import anyio

from millstream.envpool.heap import YOUNG_THRESHOLD, Heap


class Node:
    def __init__(self) -> None:
        self.other: Node | None = None


def old_cycle() -> weakref.ref[Node]:
    """A reference cycle that lived long enough to reach the oldest generation, then died:
    only a full collection frees it. Its weak reference."""
    a, b = Node(), Node()
    a.other, b.other = b, a
    gc.collect(1)  # alive: from the young generation to the middle one, then to the oldest
    gc.collect(1)
    return weakref.ref(a)


def test_settle_takes_full_collections_off_cpythons_schedule_and_restore_puts_them_back():
    before = gc.get_threshold()
    heap = Heap(full_every_s=30.0)
    heap.settle()
    try:
        young, middle, oldest = gc.get_threshold()
        assert (young, middle) == (YOUNG_THRESHOLD, before[1]) and oldest > 10**8
        # Frozen objects can still die (another test's thread dropping its last reference),
        # so the count only shrinks while we read it: the report lies between two reads.
        first = gc.get_freeze_count()
        reported = heap.statistics()["frozen"]
        assert 0 < gc.get_freeze_count() <= reported <= first
    finally:
        heap.restore()
    assert gc.get_threshold() == before and gc.get_freeze_count() == 0


def test_zero_leaves_cpythons_schedule():
    before = gc.get_threshold()
    heap = Heap(full_every_s=0)
    heap.settle()
    assert gc.get_threshold() == before and gc.get_freeze_count() == 0
    heap.restore()


def test_the_timer_collects_cycles_that_reached_the_oldest_generation():
    heap = Heap(full_every_s=0.2)
    heap.settle()
    try:
        ref = old_cycle()
        gc.collect(1)  # the young collections do not reach it
        assert ref() is not None

        async def main() -> None:
            async with anyio.create_task_group() as tg:
                tg.start_soon(heap.run)
                with anyio.fail_after(5):
                    while ref() is not None:
                        await anyio.sleep(0.05)
                tg.cancel_scope.cancel()

        anyio.run(main, backend="trio")
        stats = heap.statistics()
        assert stats["full_collections"] >= 1 and stats["full_collected"] >= 2
        assert 0 <= stats["last_pause_s"] <= stats["max_pause_s"]
    finally:
        heap.restore()
