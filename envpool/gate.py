"""The admission gate: start a group only if it can be trained within the staleness bound.

AReaL's rule, per group: with learner version `v`, staleness bound `k` and `B` groups per batch,
the groups admitted so far may not exceed `(v + k + 1) * B`. Group number `n` (counted from 0 over
the whole run) is therefore admitted once `n < (v + k + 1) * B`: it lands in batch `n // B <= v + k`,
so it is at most `k` versions old when trained, if groups are trained roughly in admission order.
The learner's replay buffer still checks every token's version, since order is not guaranteed.

Pacing admission this way, rather than generating freely and dropping what is too old, avoids the
bias peers reported (dropping stale groups favours fast, short problems) and wasted compute.

Two corrections keep the gate from starving the learner:
- groups the learner dropped (stale, too many failed members) never fill a batch, so each one
  frees a slot: the limit is raised by `dropped_groups`, which the learner announces;
- `slack` extra batches may be admitted on purpose (over-generation), e.g. to test the bound.

With several envpool workers, worker `i` of `W` owns group numbers `i, i + W, i + 2W, ...`, so
the workers share one global count without talking to each other.
"""

from __future__ import annotations

import anyio

from shared.protocol import PolicyVersion

__all__ = ["AdmissionGate"]


class AdmissionGate:
    def __init__(self, groups_per_batch: int, max_staleness: int, *, slack: int = 0,
                 worker_index: int = 0, workers: int = 1) -> None:
        if not 0 <= worker_index < workers:
            raise ValueError(f"worker_index {worker_index} outside [0, {workers})")
        self.groups_per_batch = groups_per_batch
        self.max_staleness = max_staleness
        self.slack = slack
        self.workers = workers
        self.next_group = worker_index  # the next global group number this worker may start
        self.version: int | None = None
        self.dropped_groups = 0
        self.final = False
        self.admitted = 0
        self.waits = 0
        self._changed = anyio.Event()

    def limit(self) -> int:
        """How many groups (global count) may have been admitted at the current version."""
        if self.version is None:
            return 0
        return (self.version + self.max_staleness + 1 + self.slack) * self.groups_per_batch \
            + self.dropped_groups

    def update(self, message: PolicyVersion) -> None:
        # Versions only grow within a learner session; a heartbeat repeats the current one.
        if self.version is None or message.version >= self.version:
            self.version = message.version
            self.dropped_groups = max(self.dropped_groups, message.dropped_groups)
        self.final = self.final or message.final
        self._changed.set()
        self._changed = anyio.Event()

    async def admit(self, timeout_s: float) -> int | None:
        """Wait until this worker's next group may start; returns its global group number.

        Returns None once the learner is final. Raises TimeoutError if the learner says nothing
        (it sends a heartbeat every second) for `timeout_s`: it is gone or stuck, an error, not a
        reason to wait forever.
        """
        while not self.final and self.next_group >= self.limit():
            self.waits += 1
            try:
                with anyio.fail_after(timeout_s):
                    await self._changed.wait()
            except TimeoutError:
                raise TimeoutError(f"no policy version from the learner for {timeout_s}s "
                                   f"(gate at {self.statistics()})") from None
        if self.final:
            return None
        number = self.next_group
        self.next_group += self.workers
        self.admitted += 1
        return number

    def statistics(self) -> dict[str, int | None]:
        return {"version": self.version, "limit": self.limit(), "admitted": self.admitted,
                "next_group": self.next_group, "dropped_groups": self.dropped_groups,
                "waits": self.waits}
