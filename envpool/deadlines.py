"""Coarse deadlines for thousands of waits, kept by one task: a timer wheel.

    deadlines = Deadlines()
    tg.start_soon(deadlines.run)
    timer = deadlines.call_at(anyio.current_time() + 5.0, scope.cancel)
    ...
    deadlines.cancel(timer)          # it did not expire

Why not a cancel scope with a deadline per wait: every turn of every episode has two timed
waits (the generation and the environment's step), and trio keeps every scope deadline in a
heap. Entering, leaving and pruning those scopes was about a quarter of an envpool worker's CPU
at 1,000 live episodes (bench/README.md, "envpool against asyncio + HTTP"). Timeouts here are
seconds long and only need to be roughly on time, so they go into buckets of `tick_s`: adding
and removing one is a dict operation, and one task wakes every tick and fires the expired
buckets.

A deadline fires never before its time and at most about one tick after it (plus the wait for
the scheduler); within a bucket, in the order the deadlines were added. What it fires is a
plain function, run in the wheel's task: it must not block (cancelling a scope, or handing a
failure to a waiting request, is what the envpool does), and one that raises is counted and
logged, never the end of the wheel. Waits that must be exact, or that are rare, keep their own
scopes.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import anyio
import trio

from millstream.shared.obs.ratelog import RateLog

__all__ = ["Deadlines", "NEVER", "Timer", "TICK_S", "now", "running_deadlines"]

#: The wheel's resolution: how late a deadline may fire. The envpool's timeouts are seconds.
TICK_S = 0.05
#: How long an empty wheel sleeps before it looks again (a deadline added meanwhile wakes it).
IDLE_WAIT_S = 1.0

log = logging.getLogger(__name__)

Timer = tuple[int, int]
"""A deadline's handle: (its bucket, its number within the bucket)."""
#: The handle of a deadline that never fires (an infinite limit); cancelling it does nothing.
NEVER: Timer = (-1, -1)


def now() -> float:
    """The event loop's clock, the one `anyio.current_time()` reads, for the per-turn paths.

    anyio asks sniffio which library runs on every call; on trio, the envpool's loop, this reads
    trio's clock directly, for a third of the cost (a turn reads the clock about eight times).
    Under asyncio (some tests) trio has no clock to read and anyio's answers.
    """
    try:
        return trio.current_time()
    except RuntimeError:
        return anyio.current_time()


class Deadlines:
    """Buckets of callbacks by the tick they expire in; `run()` fires them as time passes.

    Bucket `k` holds the deadlines in ((k - 1) * tick_s, k * tick_s] and fires once the clock
    reads k * tick_s, so nothing fires early. Memory is one dict entry per pending deadline:
    the wheel holds at most what its callers are waiting on (`statistics()` says how many).
    """

    def __init__(self, tick_s: float = TICK_S) -> None:
        if not tick_s > 0:
            raise ValueError(f"tick_s must be > 0, got {tick_s!r}")
        self.tick_s = tick_s
        self._buckets: dict[int, dict[int, Callable[[], None]]] = {}
        self._numbers = itertools.count()
        self._next: int | None = None  # the first bucket not fired yet (set on first use)
        self._pending = 0
        self._added: anyio.Event | None = None  # set when an empty wheel gets a deadline
        self.fired = 0
        self.failed = 0  # callbacks that raised (logged; the wheel goes on)
        self._bad = RateLog(log)

    def call_at(self, when: float, fire: Callable[[], None]) -> Timer:
        """Call `fire()` once the clock (anyio.current_time) passes `when`, unless cancelled.
        An infinite `when` (a limit set to inf) never fires."""
        if not math.isfinite(when):
            return NEVER
        bucket = math.ceil(when / self.tick_s)
        if self._next is None:
            self._next = math.ceil(now() / self.tick_s)
        if bucket < self._next:  # due already: the next tick fires it
            bucket = self._next
        number = next(self._numbers)
        entries = self._buckets.get(bucket)
        if entries is None:
            entries = self._buckets[bucket] = {}
        entries[number] = fire
        self._pending += 1
        if self._added is not None:
            self._added.set()
        return bucket, number

    def cancel(self, timer: Timer) -> None:
        """Forget a deadline; one that has fired (or was cancelled) already is no error."""
        entries = self._buckets.get(timer[0])
        if entries is not None and entries.pop(timer[1], None) is not None:
            self._pending -= 1
            if not entries:
                del self._buckets[timer[0]]

    async def run(self) -> None:
        """Fire expired deadlines until cancelled (a task of whoever owns the waits)."""
        while True:
            if self._pending:
                await anyio.sleep(self.tick_s)
            else:
                self._added = anyio.Event()
                with anyio.move_on_after(IDLE_WAIT_S):
                    await self._added.wait()
                self._added = None
            self._fire_expired(now())

    def _fire_expired(self, now: float) -> None:
        last = math.floor(now / self.tick_s)  # buckets up to this one are due
        if self._next is None or not self._buckets:
            self._next = last + 1
            return
        while self._next <= last:
            entries = self._buckets.pop(self._next, None)
            self._next += 1
            if entries:
                self._pending -= len(entries)
                self.fired += len(entries)
                for fire in entries.values():
                    try:
                        fire()
                    except Exception as exc:  # a bug of one waiter must not end every wait
                        self.failed += 1
                        self._bad.event("callback", "a deadline's callback raised: %r", exc)

    def statistics(self) -> dict[str, float]:
        """Pending deadlines, buckets holding them, and deadlines fired so far."""
        return {
            "pending": self._pending,
            "buckets": len(self._buckets),
            "fired": self.fired,
            "failed": self.failed,
        }


@asynccontextmanager
async def running_deadlines() -> AsyncIterator[Deadlines]:
    """A wheel of one's own, run for the block's time (for callers without a shared one)."""
    deadlines = Deadlines()
    async with anyio.create_task_group() as tg:
        tg.start_soon(deadlines.run)
        yield deadlines
        tg.cancel_scope.cancel()
