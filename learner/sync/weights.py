"""The learner's half of weight synchronisation: form one group with the replicas, push weights.

    links = [ReplicaLink(address, keys) for address in replica_addresses]
    group = attach_group(links, infos, cfg, backend)      # one broadcast group, all replicas
    applied = push_group(group, flat, weights, version, cfg)   # packs piece k+1 while k is sent
    sender = WeightSender(address, cfg, dtype=..., keys=...)   # the same for a single replica

Every replica of the run is in ONE group (learner rank 0, then each replica's workers at their
own offset, `AttachLearner.first_rank`), so an update is one broadcast whatever the number of
replicas: NCCL runs it as a ring or tree across GPUs and hosts, gloo as a binomial tree
(`gloo::broadcast`: about log2(N+1) rounds of the buffer, not N sends from the learner).
The price of one group is that a member that dies breaks it: the fleet (learner/sync/fleet.py) then
forms a new one with the survivors, which costs each of them one short join.

The learner is a synchronous training loop, so these are plain blocking DEALER sockets with
poll timeouts rather than the anyio `Channel`: there is nothing else for it to do while it waits.
Every wait is bounded (`learner.sync_timeout_s`); a missing or failed replica is an error
naming what was expected, never a hang.

The flat buffer is allocated once (the model's shapes do not change) and reused for every push.
A push is pipelined and copies as little as it can: large tensors are broadcast from where they
lie, small ones are packed a piece at a time (a piece closes at `learner.sync_bucket_mb`),
each piece's broadcast starting as soon as it is ready, so packing overlaps the wire
(`FlatWeights`). The replicas receive while they generate and pause only to load
(actor/link.py). The end of a run compares every replica's digest with the digest of the last
push (`replica_weights`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from millstream.learner.sync.layout import FlatWeights, LayoutChanged
from millstream.shared.config import ConfigError, LearnerConfig
from millstream.shared.wire import (
    ActorInfo,
    AttachLearner,
    Codec,
    ErrorReply,
    Hello,
    Message,
    WeightsApplied,
    WeightUpdate,
)
from millstream.shared.wire.keys import RunKeys, secure
from millstream.shared.wire.weightsync import (
    gpu_identity,
    make_group,
    mark_session,
    new_session,
    open_store,
    pick_backend,
    start_broadcast,
    wait_all,
)

__all__ = [
    "group_backend",
    "WeightSender",
    "WeightSyncError",
    "ReplicaLink",
    "WeightGroup",
    "attach_group",
    "push_group",
]

log = logging.getLogger(__name__)

M = TypeVar("M", bound=Message)


class WeightSyncError(RuntimeError):
    """A replica refused or failed an attach or a weight update, or did not answer in time.

    `failed` lists the indexes (in the call's list of links) of the replicas at fault; empty
    when it cannot be told (then every member is suspect)."""

    def __init__(self, message: str, failed: list[int] | None = None) -> None:
        super().__init__(message)
        self.failed = failed or []


#: Largest frame the learner takes from a replica (its replies are a few hundred bytes).
REPLY_FRAME_BYTES = 1 << 20


class ReplicaLink:
    """The learner's DEALER socket to one replica, and a monitor that says when it dropped."""

    def __init__(self, address: str, keys: RunKeys | None) -> None:
        self.address = address
        self._keys = keys
        self._codec = Codec()
        self._probing = False
        self._sock, self._monitor = self._connect()

    def _connect(self) -> tuple[zmq.Socket[bytes], zmq.Socket[bytes]]:
        sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        # A replica's replies are a few hundred bytes: whatever answers at its address gets no
        # more of this process's memory than that, with room.
        sock.setsockopt(zmq.MAXMSGSIZE, REPLY_FRAME_BYTES)
        secure(sock, self._keys, bind=False)
        monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        sock.connect(self.address)
        return sock, monitor

    def send(self, message: Message, timeout_s: float = 30.0) -> None:
        """Send, waiting at most `timeout_s` for a connection to take it.

        A DEALER has nowhere to put a message while no connection is up (none completed its
        handshake yet, or the replica refused this process's keys and dropped it), and a plain
        send would then block for good.
        """
        if not self._sock.poll(int(timeout_s * 1000), zmq.POLLOUT):
            raise WeightSyncError(
                f"no connection to the replica at {self.address} took {type(message).__name__} "
                f"within {timeout_s:.0f}s (is it running, and does it use this run's keys?)"
            )
        self._sock.send(self._codec.encode([message]), zmq.NOBLOCK)

    def reconnect(self) -> None:
        """A fresh socket: nothing queued for or from the old one is read as an answer."""
        self.close()
        self._sock, self._monitor = self._connect()
        self._probing = False

    def dropped(self) -> bool:
        """Without blocking: did the connection drop since the last call (the replica died)?"""
        seen = False
        while self._monitor.poll(0):
            recv_monitor_message(self._monitor)
            seen = True
        return seen

    def answers_hello(self, client: str) -> ActorInfo | None:
        """Without blocking: the replica's answer to the Hello this sends on its first call."""
        if not self._probing:
            if not self._sock.poll(0, zmq.POLLOUT):
                return None  # no connection up yet: ask on a later call
            self.send(Hello(client), timeout_s=0)
            self._probing = True
        while self._sock.poll(0):
            for reply in self._codec.decode(self._sock.recv()):
                if isinstance(reply, ActorInfo):
                    self._probing = False
                    return reply
        return None

    def await_reply(self, expect: type[M], timeout_s: float, what: str) -> M:
        """The next `expect` from the replica; raises WeightSyncError on a refusal or timeout."""
        deadline = time.monotonic() + timeout_s
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        while (left := deadline - time.monotonic()) > 0:
            ready = dict(poller.poll(int(left * 1000) + 1))
            if self._sock not in ready:
                if self._monitor in ready and self.dropped():  # it died: no answer is coming
                    raise WeightSyncError(
                        f"no {expect.__name__} from the replica at {self.address}: it closed the "
                        f"connection after {what} (it died, or refused this process's keys)"
                    )
                continue
            for reply in self._codec.decode(self._sock.recv()):
                if isinstance(reply, expect):
                    return reply
                if isinstance(reply, ErrorReply):
                    raise WeightSyncError(
                        f"replica at {self.address} refused {what}: {reply.cause}: {reply.message}"
                    )
                log.debug("ignoring %s while waiting for %s", type(reply).__name__, expect.__name__)
        hint = (
            " (is it running, and does it use this run's keys? A replica started elsewhere needs "
            "the same transport.keys_dir)"
            if self._keys is not None and what == "Hello"
            else ""
        )
        raise WeightSyncError(
            f"no {expect.__name__} from the replica at {self.address} within {timeout_s:.0f}s "
            f"after {what}{hint}"
        )

    def request(self, message: Message, expect: type[M], timeout_s: float) -> M:
        self.send(message, timeout_s)
        return self.await_reply(expect, timeout_s, what=type(message).__name__)

    def close(self) -> None:
        self._sock.disable_monitor()
        self._monitor.close(linger=0)
        self._sock.close(linger=0)


@dataclass
class WeightGroup:
    """One formed broadcast group: its session, store and process group, and its members."""

    session: str
    links: list[ReplicaLink]
    store: Any
    group: Any
    world: int


def group_backend(configured: str, infos: list[ActorInfo], strict: bool = True) -> str:
    """The backend of a group of this learner and the replicas of `infos`: `pick_backend` over
    the GPU of every member (the learner's current device, then each replica's workers). An
    explicit 'nccl' that cannot work is, at the run's start (`strict`), a ConfigError: forming
    it again would fail the same way, so the learner stops and says why. Later it is a failed
    group (WeightSyncError): a replica that joins on a GPU already in use is refused, not the
    run stopped."""
    own = gpu_identity(torch.device("cuda", torch.cuda.current_device())) if torch.cuda.is_available() else ""
    gpus = [own] + [gpu for info in infos for gpu in info.gpus or [""] * info.weight_ranks]
    try:
        backend = pick_backend(configured, gpus)
    except ValueError as exc:
        raise (ConfigError if strict else WeightSyncError)(str(exc)) from None
    on_gpus = [gpu for gpu in gpus if gpu]
    if configured == "auto" and len(set(on_gpus)) < len(on_gpus):
        log.info("two members of the weight group share a GPU, which NCCL cannot connect: gloo")
    return backend


def attach_group(
    links: list[ReplicaLink],
    infos: list[ActorInfo],
    cfg: LearnerConfig,
    backend: str,
    session: str | None = None,
) -> WeightGroup:
    """Form one group with every replica of `links` (whose `infos` give their weight ranks).

    Raises WeightSyncError when the group cannot form within `learner.sync_timeout_s`; `failed`
    names the replicas that refused, or is empty when all of them timed out together (a member
    that died makes every other join wait for it).
    """
    session = session or new_session()  # a new one per group by default
    world = 1 + sum(info.weight_ranks for info in infos)
    store = open_store(cfg.sync_host, 0, world, is_master=True, timeout_s=cfg.sync_timeout_s)
    mark_session(store, session)  # each replica checks it before its engine joins
    first = 1
    for link, info in zip(links, infos):
        link.send(
            AttachLearner(
                session, cfg.sync_host, store.port, world, backend, cfg.sync_timeout_s, first_rank=first
            ),
            cfg.sync_timeout_s,
        )
        first += info.weight_ranks
    try:
        group = make_group(store, 0, world, backend, cfg.sync_timeout_s, session)
    except RuntimeError as exc:  # who is at fault is for a Hello to tell (learner/sync/fleet.py)
        raise WeightSyncError(f"the weight group did not form: {exc}") from exc
    failed = _refusals(links, ActorInfo, cfg.sync_timeout_s, "AttachLearner")
    if failed:
        raise WeightSyncError(f"{len(failed)} of {len(links)} replicas failed to attach", failed)
    return WeightGroup(session, links, store, group, world)


def push_group(
    group: WeightGroup,
    flat: FlatWeights,
    named_weights: Iterable[tuple[str, torch.Tensor]],
    version: int,
    cfg: LearnerConfig,
) -> list[WeightsApplied]:
    """Broadcast `named_weights` as `version` to every member, piece by piece (`FlatWeights`);
    their `WeightsApplied`, in order. Raises WeightSyncError naming the members
    that failed (the group is then broken)."""
    flat.forget_sent()  # the last push's tensors go before this push's are made
    weights = list(named_weights)
    try:
        flat.lay_out(weights)  # the layout goes out before the first byte
    except LayoutChanged as exc:
        raise WeightSyncError(str(exc)) from exc
    update = WeightUpdate(group.session, version, flat.dtype, flat.numel, flat.layout, flat.piece_ends)
    for link in group.links:
        link.send(update, cfg.sync_timeout_s)
    works: list[Any] = []
    try:
        for piece in flat.sources(weights):  # packs piece k+1 while piece k is on the wire
            works.append(start_broadcast(group.group, piece, cfg.sync_timeout_s))
        wait_all(works, cfg.sync_timeout_s)
    except RuntimeError as exc:
        # A member died. The others' receives end once this side drops the group (the caller
        # does), and which of them still lives is for a Hello to tell (learner/sync/fleet.py).
        raise WeightSyncError(f"the broadcast of version {version} failed: {exc}") from exc
    flat.sent_version = version
    applied: list[WeightsApplied] = []
    failed = []
    deadline = time.monotonic() + cfg.sync_timeout_s
    for i, link in enumerate(group.links):
        try:
            reply = link.await_reply(WeightsApplied, max(0.1, deadline - time.monotonic()), "WeightUpdate")
        except WeightSyncError as exc:
            log.warning("%s", exc)
            failed.append(i)
            continue
        if reply.version != version:
            failed.append(i)
        applied.append(reply)
    if failed:
        raise WeightSyncError(f"{len(failed)} of {len(group.links)} replicas did not apply {version}", failed)
    return applied


def _refusals(links: list[ReplicaLink], expect: type[Message], timeout_s: float, what: str) -> list[int]:
    """Indexes of the links that do not answer `expect` within one shared deadline."""
    deadline = time.monotonic() + timeout_s
    failed = []
    for i, link in enumerate(links):
        try:
            link.await_reply(expect, max(0.1, deadline - time.monotonic()), what)
        except WeightSyncError as exc:
            log.warning("%s", exc)
            failed.append(i)
    return failed


class WeightSender:
    """The same exchanges with one replica: attach, then push. Tests and benchmarks use it; a
    run's learner uses the fleet (learner/sync/fleet.py), which does this for many."""

    def __init__(
        self,
        actor_address: str,
        cfg: LearnerConfig,
        *,
        dtype: str,
        keys: RunKeys | None,
        hello_timeout_s: float | None = None,
    ) -> None:
        self.address = actor_address
        #: The first answer may take an engine's whole start-up (actor.startup_timeout_s).
        self.hello_timeout_s = hello_timeout_s or cfg.sync_timeout_s
        self.cfg = cfg
        self.dtype = dtype
        self.backend = pick_backend(cfg.sync_backend)
        self.session = new_session()
        self.link = ReplicaLink(actor_address, keys)
        self.flat = FlatWeights(dtype, self.backend, cfg.sync_bucket_mb)
        self.group: WeightGroup | None = None
        self.info: ActorInfo | None = None
        self.last_push_s = 0.0

    def attach(self) -> ActorInfo:
        """Say hello, form the group with the replica; returns the replica's info."""
        info = self.link.request(Hello(self.session), ActorInfo, self.hello_timeout_s)
        if info.dtype != self.dtype:
            raise WeightSyncError(f"actor runs {info.dtype} weights but the learner sends {self.dtype}")
        self.backend = group_backend(self.cfg.sync_backend, [info])
        self.flat = self.flat.over(self.backend)
        started = time.monotonic()
        self.group = attach_group([self.link], [info], self.cfg, self.backend, self.session)
        self.info = info
        log.info(
            "attached to actor %s (%d weight ranks, %s) in %.2fs",
            self.address,
            info.weight_ranks,
            self.backend,
            time.monotonic() - started,
        )
        return info

    def push(self, named_weights: Iterable[tuple[str, torch.Tensor]], version: int) -> dict[str, float]:
        """Broadcast the weights as `version`; returns timing and size metrics."""
        if self.group is None:
            raise WeightSyncError("push() before attach()")
        started = time.monotonic()
        (applied,) = push_group(self.group, self.flat, named_weights, version, self.cfg)
        done = time.monotonic()
        self.last_push_s = done - started
        return {
            "sync/total_s": done - started,
            "sync/actor_receive_s": applied.receive_s,
            "sync/actor_paused_s": applied.paused_s,
            "sync/actor_tokens": float(applied.tokens),
            "sync/bytes": float(self.flat.nbytes),
        }

    def close(self) -> None:
        self.group = None
        self.link.close()
