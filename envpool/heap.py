"""The worker's garbage collector, set for thousands of live episodes.

CPython's cyclic collector scans every tracked object in a full (oldest-generation) collection,
and schedules one whenever the objects that survived into that generation since the last one
reach a quarter of it. An envpool worker at 10,000 live episodes holds about a million tracked
objects, most of them alive for the seconds an episode takes, so they keep surviving into the
oldest generation and that rule fires more than once a second: measured on this project's
2-core machine, 16 full collections of about 0.24 s each in 10 s of the worker's CPU, 40% of it
(bench/README.md, "A leaner envpool"). Reference counting frees nearly all an episode leaves
behind (a forced full collection in that run found nothing to collect), so here:

- the objects of the worker's start (modules, tokenizer, templates) are frozen: no collection
  scans them again (`gc.freeze`, as vLLM's engine does after it loads);
- full collections run on a timer, every `envpool.gc_full_every_s`, instead of by the quarter
  rule; the young generations still collect by count (every `YOUNG_THRESHOLD` allocations),
  so a cycle that dies young (a failed request's traceback) goes soon;
- `gc_full_every_s = 0` leaves CPython's own schedule.

What a full collection costs (its pause stalls every episode of the worker) and how many it
ran are in the worker's statistics (`gc`).
"""

from __future__ import annotations

import gc
import time

import anyio

__all__ = ["Heap"]

#: The oldest generation's threshold while full collections are on the timer: never reached.
_NEVER = 1 << 30
#: Allocations between young collections (CPython's default is 700). A turn allocates a few
#: hundred objects; collecting less often lets more of them die first, and measured 6-8% more
#: turns/s at 1,000 live episodes (no difference at 10,000).
YOUNG_THRESHOLD = 10_000


class Heap:
    """The worker's collector policy; `run()` does the timed full collections."""

    def __init__(self, full_every_s: float) -> None:
        self.full_every_s = full_every_s
        self.full_collections = 0
        self.full_collected = 0  # objects found unreachable by the timed collections
        self.last_pause_s = 0.0
        self.max_pause_s = 0.0
        self._saved: tuple[int, int, int] | None = None

    def settle(self) -> None:
        """Freeze what the start created and take full collections off CPython's schedule."""
        if self.full_every_s <= 0:
            return
        gc.collect()
        gc.freeze()
        self._saved = gc.get_threshold()
        gc.set_threshold(YOUNG_THRESHOLD, self._saved[1], _NEVER)

    def restore(self) -> None:
        """CPython's own schedule again (the worker is done; a test process goes on). It
        unfreezes everything, also what someone froze before `settle`."""
        if self._saved is not None:
            gc.set_threshold(*self._saved)
            gc.unfreeze()
            self._saved = None

    async def run(self) -> None:
        """A full collection every `full_every_s` until cancelled (nothing when it is 0)."""
        if self.full_every_s <= 0:
            await anyio.sleep_forever()
        while True:
            await anyio.sleep(self.full_every_s)
            self.collect()

    def collect(self) -> None:
        started = time.perf_counter()
        self.full_collected += gc.collect()
        self.last_pause_s = time.perf_counter() - started
        self.max_pause_s = max(self.max_pause_s, self.last_pause_s)
        self.full_collections += 1

    def statistics(self) -> dict[str, float]:
        counts = gc.get_count()
        return {
            "full_every_s": self.full_every_s,
            "full_collections": self.full_collections,
            "full_collected": self.full_collected,
            "last_pause_s": round(self.last_pause_s, 4),
            "max_pause_s": round(self.max_pause_s, 4),
            "frozen": gc.get_freeze_count(),
            "pending_young": counts[0],
        }
