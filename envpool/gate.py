"""The admission gate: start a group only if it can be trained within the staleness bound.

AReaL's rule, per group: with learner version `v`, staleness bound `k` and `B` groups per batch,
the groups admitted so far may not exceed `(v + k + 1) * B`. Group number `n` (counted over the
whole run) is therefore admitted once `n < (v + k + 1) * B`: it lands in batch `n // B <= v + k`,
so it is at most `k` versions old when trained, if groups are trained roughly in admission order.
The learner's replay buffer still checks every token's version, since order is not guaranteed.

Pacing admission this way, rather than generating freely and dropping what is too old, avoids the
bias peers reported (dropping stale groups favours fast, short problems) and wasted compute.

The learner computes the bound and announces it as `PolicyVersion.admit_limit`, because two
corrections need its counts:
- groups it dropped (stale, too many failed members, filtered) never fill a batch, so each one
  frees a slot, or the gate would wait forever for batches that cannot fill;
- after a resume, numbering continues at `group_base` (past every group the previous session
  saw); groups of an earlier session that are consumed in this one (restored from the
  checkpoint, or still running when a learner restarted) free no slot, so a restart
  over-admits once, by the groups then in flight, never for good.
`envpool.admission_slack` extra batches may be admitted on purpose (over-generation), e.g. to
test the learner's bound. The formula is `shared.wire.admit_limit`.

With several envpool workers, worker `i` of `W` owns group numbers `base + i, base + i + W, ...`,
so the workers share one global count without talking to each other. A restarted worker (same
index, new process) continues at `PolicyVersion.next_groups[i]`, after every group its earlier
processes announced (`GroupStarted`) that the learner heard of, and past the last group its
lineage file names (`numbered_past`: envpool/lineage.py), which also counts the announcements
that died with a process; so no group number is used twice.
"""

from __future__ import annotations

import anyio

from millstream.shared.wire import PolicyVersion

__all__ = ["AdmissionGate"]


class AdmissionGate:
    def __init__(self, *, worker_index: int = 0, workers: int = 1, numbered_past: int = 0) -> None:
        if not 0 <= worker_index < workers:
            raise ValueError(f"worker_index {worker_index} outside [0, {workers})")
        self.worker_index = worker_index
        self.workers = workers
        #: The first number past every group this index's earlier processes announced.
        self.numbered_past = numbered_past
        self.version: int | None = None
        self.limit = 0
        self.group_base: int | None = None
        self.next_group = 0  # set from group_base by the first announcement
        self.final = False
        #: The learner session whose announcements this gate follows.
        self.session = ""
        self.admitted = 0
        self.waits = 0
        self._changed = anyio.Event()

    def update(self, message: PolicyVersion) -> None:
        new_session = message.session != self.session
        if self.group_base is None or message.group_base != self.group_base or new_session:
            # A learner session's first announcement, or a new base: numbering starts at the
            # base, past the groups an earlier process of this worker started (next_groups),
            # and never goes back within this process.
            fresh = self.group_base is None
            self.group_base, self.session = message.group_base, message.session
            floor = max(message.group_base + self.worker_index, self.numbered_past)
            if self.worker_index < len(message.next_groups):
                floor = max(floor, message.next_groups[self.worker_index])
            if not fresh:
                floor = max(floor, self.next_group)
            self.next_group = self._aligned(floor)
            self.version, self.limit = None, 0  # the new session's own bound
        # Versions and limits only grow within a session; a heartbeat repeats them.
        self.version = max(self.version or 0, message.version)
        self.limit = max(self.limit, message.admit_limit)
        self.final = self.final or message.final
        self._changed.set()
        self._changed = anyio.Event()

    async def admit(self, start_timeout_s: float, silence_timeout_s: float) -> int | None:
        """Wait until this worker's next group may start; returns its global group number.

        Returns None once the learner is final. Raises TimeoutError if the learner says nothing
        for too long: `start_timeout_s` before its first version (it first waits for the actor to
        load and take its weights), `silence_timeout_s` after that (it sends a heartbeat every
        second between steps). A silent learner is gone or stuck: an error, not a reason to wait
        forever.
        """
        while not self.final and (self.version is None or self.next_group >= self.limit):
            self.waits += 1
            first = self.version is None
            timeout_s = start_timeout_s if first else silence_timeout_s
            try:
                with anyio.fail_after(timeout_s):
                    await self._changed.wait()
            except TimeoutError:
                what = "first policy version" if first else "policy version"
                raise TimeoutError(
                    f"no {what} from the learner for {timeout_s}s (gate at {self.statistics()})"
                ) from None
        if self.final:
            return None
        number = self.next_group
        self.next_group += self.workers
        self.admitted += 1
        return number

    def _aligned(self, floor: int) -> int:
        """The first number >= floor that is this worker's (base + index, modulo workers)."""
        assert self.group_base is not None
        offset = (floor - self.group_base - self.worker_index) % self.workers
        return floor + (self.workers - offset) % self.workers

    def statistics(self) -> dict[str, int | None]:
        return {
            "version": self.version,
            "limit": self.limit,
            "admitted": self.admitted,
            "next_group": self.next_group,
            "group_base": self.group_base,
            "waits": self.waits,
        }
