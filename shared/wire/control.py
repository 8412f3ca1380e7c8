"""Control, learner -> everyone: the policy version, the admission bound, the live replicas.

    learner PUB  --PolicyVersion (with the live replicas)-->  envpool SUB
    actor PUSH   --ReplicaJoin / ReplicaLeave-->  learner PULL

Also the group numbering every role shares (`group_id`, `group_number`), the admission limit
the learner announces (`admit_limit`), and `ErrorReply`, the answer to a frame that could not be
handled.
"""

from __future__ import annotations

import msgspec

from millstream.shared.wire.base import Id, WireMessage
from millstream.shared.wire.causes import ReplyCause

__all__ = [
    "PolicyVersion",
    "ReplicaRef",
    "Settled",
    "ReplicaJoin",
    "ReplicaLeave",
    "admit_limit",
    "group_id",
    "group_number",
    "ErrorReply",
]


class PolicyVersion(WireMessage, tag="version", frozen=True):
    """The learner's policy version and the admission bound derived from it.

    Groups are numbered over the whole run (`group_id(n)`); an envpool worker may start group `n`
    only while `n < admit_limit`. The learner computes the limit (the staleness rule, in
    envpool/gate.py's docstring) because only it knows how many groups were trained or dropped,
    and, after a resume, where numbering continues (`group_base`).
    """

    version: int
    #: Group numbers below this may be started.
    admit_limit: int
    #: First group number of this learner session: a resumed run continues numbering (and
    #: environment seeds) after every group the previous session saw.
    group_base: int = 0
    #: True once the learner has finished: workers stop admitting and report `PoolDone`.
    final: bool = False
    #: Per worker index, the group number its next process continues from (after the groups
    #: its earlier processes started); empty until a worker started a group.
    next_groups: list[int] = []
    #: The learner session; a new one (a restarted learner) makes every worker say hello again.
    session: str = ""
    #: The actor replicas that hold this version's weights and take requests. None: the learner
    #: names none, and workers use the configured `actor.connect` / `actor.address`.
    replicas: list[ReplicaRef] | None = None
    #: Per live worker process, how many of its results the learner's latest checkpoint holds:
    #: the worker may forget those and keeps the rest to push again to a restarted learner
    #: (envpool/redelivery.py). None: this learner saves no checkpoints, so nothing is kept.
    settled: list[Settled] | None = None


class Settled(msgspec.Struct, array_like=True, frozen=True):
    """Of the results worker `index` (process `incarnation`) pushed, the first `reports` are in
    the learner's latest checkpoint (learner/episodes/workers.py counts them as they arrive)."""

    index: int
    incarnation: Id
    reports: int


class ReplicaRef(msgspec.Struct, array_like=True, frozen=True):
    """A replica the learner attached: where it listens, and `epoch`, which grows every time the
    learner (re)attaches it. A worker whose connection to a replica dropped sends it nothing
    until a larger epoch says that the learner brought it (or its restart) to its weights."""

    name: Id
    address: str
    epoch: int


class ReplicaJoin(WireMessage, tag="replica_join", frozen=True):
    """An actor replica started by hand (`millstream actor --join`) asks the run to take it.

    The learner attaches it, pushes the current weights, then announces it; only then does any
    episode send it a request. Sent again every few seconds until the learner attaches.
    """

    name: Id
    address: str
    incarnation: str


class ReplicaLeave(WireMessage, tag="replica_leave", frozen=True):
    """A replica is draining (SIGTERM): the learner stops announcing it and forms its weight
    group without it; its live turns finish, or move to other replicas."""

    name: Id
    incarnation: str


def admit_limit(
    *, group_base: int, consumed: int, carried: int, groups_per_batch: int, max_staleness: int, slack: int
) -> int:
    """The `PolicyVersion.admit_limit` the learner announces (envpool/gate.py explains why).

    `consumed`: groups of this learner session trained or dropped; `carried`: groups that hold
    a slot without having been admitted by this session (the learner passes 0: see
    learner/loop/leader.py `_all_greeted`). For a fresh run this is AReaL's
    `(v + k + 1 + slack) * B` plus the dropped groups.
    """
    return group_base + (max_staleness + 1 + slack) * groups_per_batch + consumed - carried


def group_id(number: int) -> str:
    """The wire name of group `number` (numbers are global over a run)."""
    return f"g{number}"


def member_id(gid: str, member: int) -> str:
    """The episode id of member `member` of group `gid` (the worker names its episodes so)."""
    return f"{gid}-e{member}"


def group_of(episode_id: str) -> str:
    """Inverse of `member_id`: the group an episode id names."""
    return episode_id.rsplit("-e", 1)[0]


def group_number(gid: str) -> int:
    """Inverse of `group_id`; raises ValueError naming the id if it is not one."""
    if not gid.startswith("g") or not gid[1:].isdigit():
        raise ValueError(f"not a group id: {gid!r} (expected 'g<number>')")
    return int(gid[1:])


class ErrorReply(WireMessage, tag="error", frozen=True):
    """Answer to a frame that could not be handled (malformed, wrong protocol, unknown kind)."""

    cause: ReplyCause
    message: str
