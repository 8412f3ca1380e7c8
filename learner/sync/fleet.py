"""The learner's replicas: who they are, which hold the current weights, and one group for all.

    fleet = Fleet(cfg, keys, run_dir)
    fleet.start(weights, version)          # every configured replica attached, weights pushed
    fleet.push(weights, version)           # one broadcast reaches every live replica
    fleet.follow(weights, version)         # once per loop: losses, restarts, joins, leaves
    fleet.announced()                      # the replicas envpool workers may route to

The fleet is the run's registry of replicas. It starts with the replicas of the config (those
the launcher starts, or `actor.connect`), takes more at run time (`ReplicaJoin`, sent by
`millstream actor --join`) and lets them go (`ReplicaLeave`, a draining replica). A replica is
*up* once it is in the current weight group and holds the current version; only up replicas are
announced, so no episode reaches a replica before its weights do.

A replica is lost when its connection drops (its process died), when the launcher restarted it
(its pid file changed), or when an attach or a push fails on it. The group it was in is then
broken: the fleet forms a new one with every replica still answering (`learner/sync/weights.py`) and
pushes the current weights. Training never waits for a lost replica: pushes go to whoever is up
(none: they are skipped, and the next replica to come back gets the weights first), and the
longest any step waits on a broken group is one `learner.sync_timeout_s`. A restarted replica
answers a Hello again, is attached, pushed to, and announced with a larger *epoch*, which tells
the envpool that it holds the current weights again (envpool/actors/router.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from millstream.learner.sync.layout import FlatWeights
from millstream.learner.sync.weights import (
    ReplicaLink,
    WeightGroup,
    WeightSyncError,
    attach_group,
    group_backend,
    push_group,
)
from millstream.shared.config import Config
from millstream.shared.wire import (
    ActorInfo,
    DigestWeights,
    Hello,
    ReplicaJoin,
    ReplicaLeave,
    ReplicaRef,
    WeightsApplied,
    WeightsDigest,
)
from millstream.shared.wire.keys import RunKeys
from millstream.shared.wire.replicas import JOIN_EVERY_S, replica_addresses, replica_name
from millstream.shared.wire.weightsync import pick_backend

__all__ = ["Fleet", "Member"]

log = logging.getLogger("learner")

Weights = Callable[[], Iterable[tuple[str, torch.Tensor]]]

#: A Hello left unanswered this long is sent again on a fresh socket.
HELLO_EVERY_S = 5.0


@dataclass
class Member:
    """One replica as the learner sees it."""

    name: str
    address: str
    link: ReplicaLink
    #: The launcher's pid file for this replica (None: not started by this run's launcher).
    pid_file: Path | None = None
    #: Started by hand (`--join`): forgotten when it leaves; configured ones are waited for.
    joined: bool = False
    incarnation: str = ""
    up: bool = False
    epoch: int = 0
    info: ActorInfo | None = None
    answered: ActorInfo | None = None  # its answer to the current Hello, while down
    asked: float = 0.0
    pid: str | None = None
    tokens: int = 0  # tokens generated, as of its last WeightsApplied
    served: int = 0  # of which since the previous step
    losses: int = 0
    #: It said ReplicaLeave (draining): not asked again until its process changes.
    left: bool = False
    #: Groups it failed to join in a row, and when it may be tried again (backoff).
    failures: int = 0
    retry_at: float = 0.0
    #: When a joined replica last said ReplicaJoin (one that stops is forgotten).
    seen: float = 0.0


class Fleet:
    def __init__(self, cfg: Config, keys: RunKeys | None, run_dir: Path) -> None:
        self.cfg, self.keys = cfg, keys
        self.backend = pick_backend(cfg.learner.sync_backend)
        self.flat = FlatWeights(cfg.model.dtype, self.backend, cfg.learner.sync_bucket_mb)
        self.group: WeightGroup | None = None
        #: The members of `group`, in its rank order.
        self.in_group: list[Member] = []
        self.members: dict[str, Member] = {}
        self.last_push: dict[str, float] = {}
        # Epochs must grow across learner restarts too (a worker compares them with the one
        # it saw before): they start from the clock, in milliseconds.
        self._epochs = time.time_ns() // 1_000_000
        #: Replicas lost, attaches that failed, groups formed (for the metrics).
        self.lost = self.formed = self.failed_forms = 0
        supervised = bool(cfg.run.max_restarts)
        if cfg.actor.connect:
            self._add("actor", cfg.actor.connect)
        else:
            for i, address in enumerate(replica_addresses(cfg)):
                name = replica_name(i)
                self._add(name, address, run_dir / f"{name}.pid" if supervised else None)

    def _add(self, name: str, address: str, pid_file: Path | None = None, **kw: Any) -> Member:
        member = Member(name, address, ReplicaLink(address, self.keys), pid_file, **kw)
        member.pid = self._read_pid(member)
        self.members[name] = member
        return member

    # --- the start ----------------------------------------------------------------------------

    def start(self, weights: Weights, version: int) -> dict[str, float]:
        """Wait for every configured replica's first answer (an engine may take minutes to
        load: actor.startup_timeout_s), form the group, push `version`."""
        timeout_s = self.cfg.actor.startup_timeout_s
        for member in self.members.values():
            member.answered = member.link.request(Hello("learner"), ActorInfo, timeout_s)
            if member.answered.dtype != self.cfg.model.dtype:
                raise WeightSyncError(
                    f"replica {member.name} runs {member.answered.dtype} weights but the learner "
                    f"sends {self.cfg.model.dtype} (model.dtype)"
                )
        self._form(list(self.members.values()), weights, version, strict=True)
        return self.last_push

    # --- pushes -------------------------------------------------------------------------------

    def push(self, weights: Weights, version: int) -> dict[str, float]:
        """Broadcast `version` to every up replica; {} when none is up (they get it on return)."""
        if self.group is None:
            return {}
        started = time.monotonic()
        try:
            applied = push_group(self.group, self.flat, weights(), version, self.cfg.learner)
        except WeightSyncError as exc:
            log.warning("weight push of version %d failed (%s): re-forming the group", version, exc)
            self._break()
            return {}
        for member, reply in zip(self.in_group, applied):
            member.served, member.tokens = max(0, reply.tokens - member.tokens), reply.tokens
        self.last_push = self._sync_metrics(started, applied)
        return self.last_push

    def _sync_metrics(self, started: float, applied: list[WeightsApplied]) -> dict[str, float]:
        """A push's metrics: its time, the longest receive (generation going on) and pause of a
        replica, bytes, replicas reached."""
        return {
            "sync/total_s": time.monotonic() - started,
            "sync/actor_receive_s": max(a.receive_s for a in applied),
            "sync/actor_paused_s": max(a.paused_s for a in applied),
            "sync/bytes": float(self.flat.nbytes),
            "sync/replicas": float(len(applied)),
        }

    # --- membership ---------------------------------------------------------------------------

    def follow(self, weights: Weights, version: int) -> bool:
        """Once per loop iteration: notice lost replicas, attach those that answer, push them
        `version`. True when the announced replicas changed."""
        changed = self._notice_losses() | self._forget_silent()
        answered = [m for m in self.members.values() if not m.up and self._answers(m)]
        if answered or (self.group is None and self._up()):
            up = self._up()
            changed |= self._form(up + answered, weights, version)
            if answered and up and self.group is None:  # a newcomer spoiled it: go on without
                self._back_off(answered)
                for member in up:
                    member.answered = member.info  # they formed before; re-formed at once
                changed |= self._form(up, weights, version)
        return changed

    def _back_off(self, members: list[Member]) -> None:
        """Members that did not join are asked again after a growing pause (each failed
        formation costs the others up to one sync timeout)."""
        for member in members:
            member.failures += 1
            member.retry_at = time.monotonic() + min(1800.0, 10.0 * 2**member.failures)
            log.warning(
                "replica %s failed to join the weight group (%d in a row); asking again in %.0fs",
                member.name,
                member.failures,
                member.retry_at - time.monotonic(),
            )

    def _forget_silent(self) -> bool:
        """A joined replica that is down and stopped saying ReplicaJoin is gone (killed)."""
        silent = [
            m
            for m in self.members.values()
            if m.joined and not m.up and time.monotonic() - m.seen > 10 * JOIN_EVERY_S
        ]
        for member in silent:
            log.warning("replica %s stopped asking to join: forgotten", member.name)
            self._forget(member)
        return bool(silent)

    def _up(self) -> list[Member]:
        return [m for m in self.members.values() if m.up]

    def take(self, message: ReplicaJoin | ReplicaLeave) -> None:
        """A replica's word (learner/episodes/intake.py hands these over)."""
        known = self.members.get(message.name)
        if isinstance(message, ReplicaJoin):
            if known is not None and known.incarnation == message.incarnation:
                known.seen = time.monotonic()
                return  # it repeats itself until attached
            if known is not None:  # a new process under that name: the old one is gone
                self._lose(known)
                self._forget(known)
            log.info("replica %s asks to join from %s", message.name, message.address)
            member = self._add(message.name, message.address, joined=True, incarnation=message.incarnation)
            member.seen = time.monotonic()
        elif known is not None and (not known.joined or known.incarnation == message.incarnation):
            log.info("replica %s is leaving (draining)", message.name)
            self._lose(known)
            known.left = True  # it would still answer a Hello: not asked until a new process
            if known.joined:
                self._forget(known)

    def announced(self) -> list[ReplicaRef]:
        return [ReplicaRef(m.name, m.address, m.epoch) for m in self._up()]

    def _notice_losses(self) -> bool:
        lost = False
        for member in self.members.values():
            if member.left and self._read_pid(member) != member.pid:  # restarted after a drain
                member.left, member.pid = False, self._read_pid(member)
        for member in self._up():
            pid = self._read_pid(member)
            restarted = pid != member.pid
            member.pid = pid
            if restarted or member.link.dropped():
                log.warning(
                    "replica %s %s: re-attaching once it answers",
                    member.name,
                    "restarted" if restarted else "dropped its connection",
                )
                self._lose(member)
                lost = True
        return lost

    def _answers(self, member: Member) -> bool:
        """Without blocking: has the down replica answered a Hello (sent anew every few
        seconds on a fresh socket, as the first may have gone to a dead process)?"""
        if member.answered is not None:
            return True
        if member.left or time.monotonic() < member.retry_at:
            return False
        if time.monotonic() - member.asked > HELLO_EVERY_S:
            member.link.reconnect()
            member.asked = time.monotonic()
        info = member.link.answers_hello("learner")
        if info is None:
            return False
        member.link.dropped()  # events from before this answer are about an older process
        if info.dtype != self.cfg.model.dtype:
            log.error(
                "replica %s runs %s weights, the run sends %s (model.dtype): not taken",
                member.name,
                info.dtype,
                self.cfg.model.dtype,
            )
            member.retry_at = time.monotonic() + 600.0
            return False
        member.answered = info
        return True

    def _form(self, members: list[Member], weights: Weights, version: int, strict: bool = False) -> bool:
        """A new group of `members`, pushed `version`; False (all of them down again, to be
        asked anew) when it does not form. `strict`: raise instead (the run's start)."""
        self.group = None
        for member in members:
            member.info = member.answered or member.info
        infos = [m.info for m in members]
        assert all(infos)
        started = time.monotonic()
        try:
            backend = group_backend(self.cfg.learner.sync_backend, infos, strict)  # type: ignore[arg-type]
            self.backend, self.flat = backend, self.flat.over(backend)  # where members compute decides
            self.group = attach_group([m.link for m in members], infos, self.cfg.learner, backend)  # type: ignore[arg-type]
            applied = push_group(self.group, self.flat, weights(), version, self.cfg.learner)
        except WeightSyncError as exc:
            if strict:
                raise
            self.failed_forms += 1
            log.warning("forming the weight group of %d replicas failed: %s", len(members), exc)
            self.in_group = members
            self._break()
            return True
        self.in_group = members
        for member, reply in zip(members, applied):
            member.answered = None
            member.tokens = reply.tokens
            member.pid = self._read_pid(member)  # this process is the one attached
            member.failures = 0
            if not member.up:
                self._epochs += 1
                member.up, member.epoch = True, self._epochs
        self.formed += 1
        self.last_push = self._sync_metrics(started, applied)
        log.info(
            "weight group of %d replicas (%s) at version %d in %.2fs over %s",
            len(members),
            ", ".join(m.name for m in members),
            version,
            self.last_push["sync/total_s"],
            self.backend,
        )
        return True

    def _break(self) -> None:
        """The group is broken: every member must answer a Hello again before the next one.
        Which member died cannot be told from the group (a dead member makes every other
        one's collective fail too); a Hello can: the living answer within milliseconds."""
        for member in self.in_group:
            self._lose(member)
        self.group, self.in_group = None, []

    def _lose(self, member: Member) -> None:
        if member.up:
            self.lost += 1
            member.losses += 1
        member.up = False
        member.answered = None
        member.link.reconnect()
        member.asked = time.monotonic()
        if member in self.in_group:  # its ranks are gone: the next group is formed without them
            self.group = None
            self.in_group = [m for m in self.in_group if m is not member]

    def _forget(self, member: Member) -> None:
        member.link.close()
        del self.members[member.name]

    def _read_pid(self, member: Member) -> str | None:
        if member.pid_file is None:
            return None
        try:
            return member.pid_file.read_text().strip()
        except OSError:
            return None

    # --- reports ------------------------------------------------------------------------------

    def metrics(self) -> dict[str, float]:
        """Per replica: tokens since the previous step and their share; how many are up."""
        served = sum(m.served for m in self.members.values())
        out: dict[str, float] = {
            "fleet/replicas": float(len(self.members)),
            "fleet/up": float(len(self._up())),
            "fleet/lost": float(self.lost),
            "fleet/groups_formed": float(self.formed),
        }
        for m in self.members.values():
            out[f"fleet/{m.name}/tokens"] = float(m.tokens)
            out[f"fleet/{m.name}/share"] = m.served / served if served else 0.0
        return out

    def digests(self, timeout_s: float = 60.0) -> dict[str, WeightsDigest | str]:
        """Every up replica's digest of the weights it holds (or why there is none)."""
        out: dict[str, WeightsDigest | str] = {}
        for member in self._up():
            try:
                out[member.name] = member.link.request(DigestWeights(), WeightsDigest, timeout_s)
            except WeightSyncError as exc:
                out[member.name] = str(exc)
        return out

    def close(self) -> None:
        self.group = None
        for member in self.members.values():
            member.link.close()


def replica_weights(
    digests: dict[str, WeightsDigest | str], sent: tuple[float, float, int] | None
) -> dict[str, Any]:
    """Each replica's digest against the digest of the weights the learner last sent (`sent`,
    `FlatWeights.digest`): `matches` is True when what every worker of the replica loaded last
    is what the learner sent last, to float rounding."""
    if sent is None:
        return {}
    total, abs_total, numel = sent
    out: dict[str, Any] = {"learner": {"total": total, "abs_total": abs_total, "numel": numel}}
    for name, digest in digests.items():
        if isinstance(digest, str):
            out[name] = {"error": digest}
            continue
        tolerance = 1e-9 * abs_total + 1e-9
        same = abs(digest.total - total) <= tolerance and abs(digest.abs_total - abs_total) <= tolerance
        out[name] = {
            "version": digest.version,
            "total": digest.total,
            "abs_total": digest.abs_total,
            "numel": digest.numel,
            "matches": same and digest.numel == numel,
        }
    return out
