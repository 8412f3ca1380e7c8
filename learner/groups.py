"""What the replay buffer holds (learner/replay.py): complete groups, groups still waiting for
members, and the staleness of a trajectory (the oldest version among its generated tokens)."""

from __future__ import annotations

from dataclasses import dataclass, field

from millstream.shared.wire import Trajectory

__all__ = ["BufferFull", "Group", "Pending", "oldest_version"]


class BufferFull(RuntimeError):
    """More groups than `max_groups` would be buffered: the upstream admission gate failed."""


@dataclass
class Group:
    """A complete group, as handed to the trainer."""

    group_id: str
    #: The successful members, in arrival order.
    trajectories: list[Trajectory]
    #: Members that ended as `EpisodeFailed` (or arrived malformed: see `ReplayBuffer.add`).
    failed: int
    #: Min policy version over all generated tokens (loss_mask == 1) of the trajectories.
    oldest_version: int


@dataclass
class Pending:
    """A group still waiting for members."""

    trajectories: list[Trajectory] = field(default_factory=list)
    failed: int = 0
    #: Min version over generated tokens so far; None while no trajectory has arrived.
    oldest: int | None = None
    #: (env, seed) of its first trajectory: every member plays the same environment and seed.
    identity: tuple[str, int] | None = None

    @property
    def members(self) -> int:
        return len(self.trajectories) + self.failed


def oldest_version(traj: Trajectory) -> int | None:
    """Min version over generated tokens, or None if the trajectory is malformed or has none."""
    n = len(traj.token_ids)
    if not (len(traj.loss_mask) == len(traj.logprobs) == len(traj.versions) == n):
        return None
    generated = [v for v, m in zip(traj.versions, traj.loss_mask) if m]
    return min(generated) if generated else None
