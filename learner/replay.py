"""A staleness-bounded replay buffer of GRPO groups, with exact episode accounting.

Episodes arrive one by one (a `Trajectory` or an `EpisodeFailed`), tagged with their group. GRPO
needs a whole group to compute advantages, so the buffer collects members until `group_size` of
them have arrived; a failure closes its member's slot without contributing a trajectory. A complete
group with fewer than `min_group_size` trajectories has no usable baseline and is dropped
("group_too_small").

`take_batch(version)` hands out the `groups_per_batch` groups that completed first (FIFO: the
oldest experience is trained first, which keeps staleness low). Before that it drops every group,
complete or partial, whose oldest generated token is more than `max_staleness` versions behind.
A partial group dropped that way is remembered, so its late members are counted as stale on
arrival instead of opening a fresh group that could never complete.

Every episode is accounted for exactly once. Counters are of episodes:

    received == trained + sum(dropped.values()) + sum(failed.values()) + buffered

holds after every call. Failures are counted in `failed[cause]` when they arrive (they never hold
a trajectory), so `buffered` counts trajectories only. Duplicates (an episode id its group has
already counted) are counted separately and are not part of `received`. Ids are kept per group
while the group can still be sent to (learner/seen.py): a group with all slots in that left the
buffer is *finished*, only its number kept; a later message naming it is refused by `accept`
(`group_finished`), counted as an overflow by `add`/`fail`. Memory follows the groups in flight.

`dropped_groups` counts GROUPS that left untrained (stale, too small, drained), each counted once
even if it held no trajectory: the learner announces it so the envpool's admission gate, which
counts groups, can free one slot per group that will never fill a batch.

The buffer is bounded by `max_groups` (complete + partial). The envpool's admission gate is meant
to make overflow impossible, so `add` and `fail` raise `BufferFull` on it (and ValueError on a
group_size that disagrees): a bug signal. The learner calls `accept` instead, which never raises:
what `add` or `fail` would raise on, and what learner/episodes/validate.py found wrong, is *refused*:
counted as received and dropped under `invalid_trajectory`, the reason in `refused[reason]`.
A refusal of the message's content closes its member slot (the group still completes); a refusal
of its identity (wrong group size, an environment or seed other than its group's, a full buffer,
a group never admitted) touches no group, so a forged message cannot complete or open one.
The buffer is single-threaded (the learner's receive loop owns it) and does no I/O.

learner/persist/replaystate.py carries it across a learner restart (`buffer_state` /
`load_buffer_state`; learner/persist/checkpoint.py writes the state to disk), partial groups
included: their missing members still come (replaystate.py says from where).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from millstream.learner.groups import BufferFull, Group, Pending, oldest_version
from millstream.learner.seen import SeenEpisodes, number_of
from millstream.shared.wire import Cause, DropCause, EpisodeFailed, Trajectory

__all__ = ["Group", "Pending", "ReplayBuffer", "BufferFull"]

#: Drop cause of trajectories that arrive for a group that already completed (more members than
#: `group_size`: an upstream bug, kept visible rather than silently merged into a new group).
_OVERFLOW = DropCause.GROUP_OVERFLOW

# Where an arriving episode goes (see ReplayBuffer._admit).
_OPEN, _LATE, _DUPLICATE = 0, 1, 2


class ReplayBuffer:
    """Collects episodes into groups and hands out batches of complete, fresh-enough groups."""

    def __init__(
        self,
        group_size: int,
        groups_per_batch: int,
        max_staleness: int,
        max_groups: int,
        min_group_size: int = 2,
        keep: Callable[[Group], bool] | None = None,
    ) -> None:
        if group_size < 1 or groups_per_batch < 1 or max_groups < 1 or max_staleness < 0:
            raise ValueError(
                f"invalid buffer shape: group_size={group_size}, "
                f"groups_per_batch={groups_per_batch}, max_staleness={max_staleness}, "
                f"max_groups={max_groups}"
            )
        if not 1 <= min_group_size <= group_size:
            raise ValueError(f"min_group_size={min_group_size} must be in [1, {group_size}]")
        self.group_size = group_size
        self.groups_per_batch = groups_per_batch
        self.max_staleness = max_staleness
        self.max_groups = max_groups
        self.min_group_size = min_group_size
        #: A test of one group on its own (`zero_std`: a reward spread), applied once, as the
        #: group completes: a group that fails it is dropped as FILTERED_ZERO_STD, and a batch
        #: is then `groups_per_batch` groups that pass (DAPO's dynamic sampling): fewer wait for
        #: more instead of making a smaller step. Waiting does not age them (the version moves
        #: only with a step).
        self.keep = keep

        #: Called with every dropped group's trajectories and the cause (the learner records them).
        self.on_drop: Callable[[list[Trajectory], DropCause], None] | None = None
        self._pending: dict[str, Pending] = {}
        # Insertion order is completion order, which is the FIFO order of take_batch.
        self._complete: OrderedDict[str, Group] = OrderedDict()
        # Left groups -> the cause late members are dropped under, until all slots are in (`_settle`).
        self._closed: dict[str, DropCause] = {}
        # The episode ids counted, per group, while the group can still be sent to (learner/seen.py).
        self._seen = SeenEpisodes()

        self.received = 0
        self.trained = 0
        self.duplicates = 0
        #: Duplicates among results pushed again after a learner restart (expected: `accept`).
        self.resent_duplicates = 0
        self.buffered = 0
        self.dropped_groups = 0
        #: Groups numbered below `floor` were admitted by an earlier learner session; the
        #: learner's admission counts only drops of its own (`dropped_from_floor`). Not saved:
        #: a session's own.
        self.floor = 0
        self.dropped_from_floor = 0
        self.dropped: dict[str, int] = {}
        self.failed: dict[str, int] = {}
        #: Episodes refused on arrival, by reason (all counted in dropped["invalid_trajectory"]).
        self.refused: dict[str, int] = {}
        self._last_staleness: list[int] = []
        #: Groups `keep` dropped since one passed, in completion order (the no-signal warning).
        self.rejected_in_a_row = 0

    # --- arrivals --------------------------------------------------------------------------

    def add(self, traj: Trajectory) -> None:
        """Adds a finished episode to its group (see the module docstring for what may drop it)."""
        status = self._admit(traj.episode_id, traj.group_id, traj.group_size)
        if status == _DUPLICATE:
            return
        if status == _LATE:
            self._dropped([traj], self._closed.get(traj.group_id, _OVERFLOW))
            self._settle(traj.group_id)
            return
        group = self._pending[traj.group_id]
        oldest = oldest_version(traj)
        if oldest is None:
            # Mismatched lengths or no generated token: nothing to train on and no defined
            # staleness. The member slot still closes, like a failure, so the group can complete.
            self._dropped([traj], DropCause.MALFORMED)
            group.failed += 1
        else:
            group.trajectories.append(traj)
            group.oldest = oldest if group.oldest is None else min(group.oldest, oldest)
            group.identity = group.identity or (traj.env, traj.seed)
            self.buffered += 1
        self._maybe_complete(traj.group_id, group)

    def fail(self, failure: EpisodeFailed) -> None:
        """Records a failed episode: counted under failed[cause]; its member slot is closed."""
        status = self._admit(failure.episode_id, failure.group_id, failure.group_size)
        if status == _DUPLICATE:
            return
        self._count(self.failed, failure.cause, 1)
        if status == _LATE:
            self._settle(failure.group_id)
            return
        group = self._pending[failure.group_id]
        group.failed += 1
        self._maybe_complete(failure.group_id, group)

    def accept(
        self,
        message: Trajectory | EpisodeFailed,
        refusal: tuple[str, bool] | None = None,
        *,
        remember: bool = True,
        resent: bool = False,
    ) -> str | None:
        """The learner's entry, which never raises: `add` or `fail` the message, or refuse it.

        `refusal` is (reason, closes_slot) when the learner's own checks already refused it.
        `remember=False` (an episode no worker of the run started) keeps no trace of a refused
        message's id: a peer sending endless forged episodes costs counters, not memory. Sent
        again, it is refused and counted again, as foreign again, so the accounting still adds up.
        `resent` (pushed again after a learner restart): a finished group's member is a duplicate,
        not a refusal (else the group had not finished). Returns the reason refused for, or None.
        """
        # The learner's identity refusals first (even before "a duplicate": not its sender's to
        # send); a message of no admitted group is not asked about any group.
        identity = refusal[0] if refusal is not None and not refusal[1] else None
        gid = message.group_id
        if identity is None and (
            self._seen.has(gid, message.episode_id) or (resent and self._seen.finished(gid))
        ):
            if resent:
                self.resent_duplicates += 1
            else:
                self.duplicates += 1
            return None
        identity = identity or self._identity_problem(message)
        if identity is None and refusal is None and self._seen.finished(gid):
            identity = "group_finished"  # every slot in and gone: a re-send, or not the run's
        if identity is None and refusal is None:
            if isinstance(message, Trajectory):
                self.add(message)
            else:
                self.fail(message)
            return None
        reason, closes = (identity, False) if identity is not None else refusal  # type: ignore[misc]
        self._refuse(message, reason, closes, remember)
        return reason

    def _identity_problem(self, message: Trajectory | EpisodeFailed) -> str | None:
        """Why `message` cannot belong to the group it names (then it closes no slot), or None."""
        if message.group_size != self.group_size:
            return "group_size"
        gid = message.group_id
        pending = self._pending.get(gid)
        if pending is None:
            new = not self._left(gid)
            full = len(self._pending) + len(self._complete) >= self.max_groups
            return "buffer_full" if new and full else None
        if isinstance(message, Trajectory) and pending.identity not in (None, (message.env, message.seed)):
            return "group_identity"
        return None

    def _refuse(
        self, message: Trajectory | EpisodeFailed, reason: str, closes_slot: bool, remember: bool = True
    ) -> None:
        """Counts a refusal; closes the member slot it names when `closes_slot` and its group is
        still open. Its id is kept (to count a re-send as a duplicate) when `remember` or when it
        closed a slot: a group has `group_size` slots, so forged ids that close none are never
        kept, and those that do are bounded by the admitted groups."""
        self.received += 1
        self._count(self.dropped, DropCause.INVALID_TRAJECTORY, 1)
        self.refused[reason] = self.refused.get(reason, 0) + 1
        gid = message.group_id
        room = gid in self._pending or len(self._pending) + len(self._complete) < self.max_groups
        closes = closes_slot and not self._left(gid) and room
        if remember or closes:
            self._seen.add(gid, message.episode_id)
            self._settle(gid)  # a late member of a group that left the buffer may finish it
        if not closes:
            return
        group = self._pending.setdefault(gid, Pending())
        group.failed += 1
        self._maybe_complete(gid, group)

    def _admit(self, episode_id: str, group_id: str, group_size: int) -> int:
        """Counts a new episode as received and says where it goes: _OPEN, _LATE or _DUPLICATE.

        _OPEN: its group is pending (opened here if new). _LATE: its group already left the
        buffer. Raises before counting anything, so the accounting stays exact, on a group-size
        mismatch or when opening the group would exceed `max_groups`.
        """
        if self._seen.has(group_id, episode_id):
            self.duplicates += 1
            return _DUPLICATE
        if group_size != self.group_size:
            raise ValueError(
                f"episode {episode_id!r} says group_size={group_size}, the buffer uses "
                f"{self.group_size}: envpool and learner disagree on train.group_size"
            )
        late = self._left(group_id)
        if not late and group_id not in self._pending:
            if len(self._pending) + len(self._complete) >= self.max_groups:
                raise BufferFull(
                    f"replay buffer holds max_groups={self.max_groups} groups "
                    f"({len(self._complete)} complete, {len(self._pending)} partial); the "
                    "admission gate should have prevented this"
                )
            self._pending[group_id] = Pending()
        self._seen.add(group_id, episode_id)
        self.received += 1
        return _LATE if late else _OPEN

    def _maybe_complete(self, group_id: str, group: Pending) -> None:
        if group.members < self.group_size:
            return
        del self._pending[group_id]
        self._closed[group_id] = _OVERFLOW
        if len(group.trajectories) < self.min_group_size:
            self._drop_group(group_id, group.trajectories, DropCause.GROUP_TOO_SMALL)
            return
        assert group.oldest is not None  # min_group_size >= 1, so a trajectory arrived
        done = Group(group_id, group.trajectories, group.failed, group.oldest)
        if self.keep is not None and not self.keep(done):
            self.rejected_in_a_row += 1
            self._drop_group(group_id, group.trajectories, DropCause.FILTERED_ZERO_STD)
            return
        self.rejected_in_a_row = 0
        self._complete[group_id] = done

    # --- departures ------------------------------------------------------------------------

    def take_batch(self, version: int, count: int | None = None) -> list[Group] | None:
        """Drops stale groups, then returns the `count` (default `groups_per_batch`) oldest
        complete ones, or None if fewer are complete."""
        count = self.groups_per_batch if count is None else count
        for gid, done in list(self._complete.items()):
            if version - done.oldest_version > self.max_staleness:
                del self._complete[gid]
                self._drop_group(gid, done.trajectories, DropCause.STALE)
        for gid, group in list(self._pending.items()):
            if group.oldest is not None and version - group.oldest > self.max_staleness:
                del self._pending[gid]
                self._closed[gid] = DropCause.STALE  # its late members are stale too
                self._drop_group(gid, group.trajectories, DropCause.STALE)
        if len(self._complete) < count:
            return None
        batch = [self._complete.popitem(last=False)[1] for _ in range(count)]
        for taken in batch:
            self._settle(taken.group_id)
        n = sum(len(g.trajectories) for g in batch)
        self.trained += n
        self.buffered -= n
        self._last_staleness = [version - g.oldest_version for g in batch]
        return batch

    def discard(self, groups: list[Group], cause: DropCause) -> None:
        """Groups taken by `take_batch` but not trained (a filter rejected them): counted as
        dropped under `cause`, each freeing its admission slot like any dropped group."""
        for group in groups:
            n = len(group.trajectories)
            self.trained -= n
            self.buffered += n
            self._drop_group(group.group_id, group.trajectories, cause)

    def drain(self, cause: DropCause = DropCause.RUN_ENDED) -> int:
        """Drops every buffered episode (complete and partial groups); returns how many."""
        before = self.buffered
        for gid, done in self._complete.items():
            self._drop_group(gid, done.trajectories, cause)
        for gid, group in self._pending.items():
            self._closed[gid] = cause  # late members of a drained partial group: same cause
            self._drop_group(gid, group.trajectories, cause)
        self._complete.clear()
        self._pending.clear()
        return before - self.buffered

    def _drop_group(self, gid: str, trajectories: list[Trajectory], cause: DropCause) -> None:
        self.dropped_groups += 1
        if number_of(gid) >= self.floor:
            self.dropped_from_floor += 1
        if trajectories:
            self._dropped(trajectories, cause)
            self.buffered -= len(trajectories)
        self._settle(gid)

    def _left(self, gid: str) -> bool:
        """Did the group complete or leave the buffer (finished ones included)?"""
        return gid in self._closed or gid in self._complete or self._seen.finished(gid)

    def _settle(self, gid: str) -> None:
        """Forget a group that left the buffer once all its slots are in (no message for it can be
        new then): its number stays. An id that is no number is kept (nothing else would)."""
        held = gid in self._pending or gid in self._complete or number_of(gid) < 0
        if held or self._seen.count(gid) < self.group_size:
            return
        self._seen.finish(gid)
        self._closed.pop(gid, None)

    def _dropped(self, trajectories: list[Trajectory], cause: DropCause) -> None:
        """Count dropped trajectories under `cause` and tell `on_drop` (the learner records them)."""
        self._count(self.dropped, cause, len(trajectories))
        if self.on_drop is not None:
            self.on_drop(trajectories, cause)

    def count_unreceived(self, cause: Cause, n: int) -> None:
        """`n` episodes that were started but can never arrive (their results died with a
        learner process): received and failed under `cause` at once, so the identity holds."""
        self.received += n
        self._count(self.failed, cause, n)

    @staticmethod
    def _count(counter: dict[str, int], cause: Cause | DropCause, n: int) -> None:
        key = str(cause)  # the cause's value: a plain string key (JSON, checkpoints, metrics)
        counter[key] = counter.get(key, 0) + n

    # --- numbering -------------------------------------------------------------------------

    def max_group_number(self) -> int | None:
        """The highest `shared.wire.group_number` of any group this buffer has seen (buffered,
        trained or dropped; restored ones included), or None: a resumed learner numbers after it."""
        numbers = [number_of(gid) for gid in (*self._closed, *self._pending, *self._complete)]
        finished = self._seen.highest_finished()
        return max([n for n in numbers if n >= 0] + ([] if finished is None else [finished]), default=None)

    # --- reporting -------------------------------------------------------------------------

    def statistics(self) -> dict:
        """Counters and buffer state as plain ints/floats/dicts (JSON-friendly, copies)."""
        stale = self._last_staleness
        return {
            "received": self.received,
            "trained": self.trained,
            "dropped": dict(self.dropped),
            "failed": dict(self.failed),
            "refused": dict(self.refused),
            "duplicates": self.duplicates,
            "resent_duplicates": self.resent_duplicates,
            "buffered": self.buffered,
            "dropped_groups": self.dropped_groups,
            "complete_groups": len(self._complete),
            "partial_groups": len(self._pending),
            # Of the groups returned by the last take_batch; None before the first batch.
            "staleness": (
                {"min": min(stale), "mean": sum(stale) / len(stale), "max": max(stale)} if stale else None
            ),
        }
