"""The router: one envpool worker's turns spread over the run's actor replicas.

    router = Router(cfg.transport, "w0", keys, default_address)
    router.update(policy_version.replicas)          # the learner's list, on every announcement
    gen = await router.generate(ids, affinity=episode_id, ...)
    router.release(episode_id)                      # the episode ended

It lives in the client, so a turn costs no extra hop. The rules:
- **Sticky.** An episode's turns all go to the replica that served its first turn: its prefix
  stays in that engine's KV cache, and the next turn's prefill is a cache hit.
- **Least loaded.** A new episode goes to the usable replica with the least requests live, as
  the replicas report them (`TokenDelta.load` on each final delta: the requests of every worker,
  less this worker's own at that moment, plus this worker's own now).
- **Shed.** A replica that refuses a turn as overloaded (or draining) is passed over for
  `SHED_S`; the turn goes at once to another replica, and the episode moves with it.
- **Retried elsewhere.** A turn whose replica died (`actor_lost`, from the connection monitor)
  or timed out is sent again from its start, so its partial tokens are discarded, never
  trained; the retries are counted by cause (`retries_by_cause`).
- **Usable** means: the learner announces it (`PolicyVersion.replicas`: only replicas that hold
  its weights), its connection is up, and, if that connection dropped since, the learner has
  announced it again with a larger epoch (it re-attached the replica, or its restart, and
  pushed the current weights). So a restarted engine at version 0 gets no request.
- With no usable replica (the only one restarts), a turn waits for one, up to its timeout.

A learner that announces no list (`replicas` None: an older learner, or a test's) leaves one
replica at the configured address, used whenever it is there, as the single-actor client was.
Each replica has its own DEALER socket and `ActorClient` (envpool/actors/client.py), so a dead replica
fails only its own turns.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import anyio
from anyio.abc import TaskGroup

from millstream.envpool.actors.client import ActorClient, ActorUnreachable
from millstream.envpool.actors.generation import (
    NO_RETRY,
    Generation,
    GenerationFailed,
    Retry,
    Sampling,
)
from millstream.envpool.deadlines import Deadlines, now
from millstream.shared.config import TransportConfig
from millstream.shared.obs.metrics import LatencyHistogram
from millstream.shared.wire import ActorInfo, Cause, ReplicaRef
from millstream.shared.wire.keys import RunKeys
from millstream.shared.wire.transport import Channel, open_channel

__all__ = ["Router", "SHED_S"]

log = logging.getLogger("envpool")

#: How long a replica that refused as overloaded is passed over by new turns.
SHED_S = 1.0


@dataclass
class _Replica:
    name: str
    address: str
    epoch: int
    client: ActorClient
    scope: anyio.CancelScope = field(default_factory=anyio.CancelScope)
    #: In the learner's latest list. An unlisted replica gets no new turn; its live ones go on
    #: (the learner may have dropped it only to re-form its weight group).
    listed: bool = True
    #: The epoch it had when its connection dropped; usable again at a larger one.
    blocked_at: int | None = None
    shed_until: float = 0.0
    requests: int = 0
    tokens: int = 0
    refusals: int = 0
    lost: int = 0
    failed: Counter[Cause] = field(default_factory=Counter)
    latency: LatencyHistogram = field(default_factory=LatencyHistogram)

    def load(self) -> int:
        return self.client.others_load + self.client.stats.live

    def statistics(self) -> dict[str, Any]:
        return {
            "address": self.address,
            "epoch": self.epoch,
            "connected": self.client.connected,
            "requests": self.requests,
            "tokens": self.tokens,
            "live": self.client.stats.live,
            "load": self.load(),
            "refusals": self.refusals,
            "lost": self.lost,
            "failed": {str(k): v for k, v in self.failed.items()},
            "latency": self.latency.to_dict(),
        }


class Router:
    def __init__(
        self, transport: TransportConfig, worker: str, keys: RunKeys | None, default_address: str
    ) -> None:
        self.transport, self.worker, self.keys = transport, worker, keys
        self.default_address = default_address
        self.replicas: dict[str, _Replica] = {}
        #: Replicas closed (no longer listed, nothing live), kept for their statistics.
        self.gone: dict[str, dict[str, Any]] = {}
        self._closed_totals: Counter[str] = Counter()  # their clients' counters
        self.completed = 0
        self._sticky: dict[str, str] = {}
        self._changed = anyio.Event()
        self._tg: TaskGroup | None = None
        self._pending: list[ReplicaRef] | None = None
        self.announced = False  # the learner names its replicas
        self.retries_by_cause: Counter[Cause] = Counter()
        self.moved = 0  # episodes that changed replica
        self.latency = LatencyHistogram()
        self.info: ActorInfo | None = None
        #: Every replica's turn deadlines, and the episodes' (envpool/deadlines.py); `run` runs it.
        self.deadlines = Deadlines()

    # --- membership ---------------------------------------------------------------------------

    async def run(self) -> None:
        """Hosts every replica's socket tasks; until the first `update`, the configured one."""
        async with anyio.create_task_group() as tg:
            self._tg = tg
            tg.start_soon(self.deadlines.run)
            self.update(self._pending)
            await anyio.sleep_forever()

    def update(self, replicas: list[ReplicaRef] | None) -> None:
        """Follow the learner's list: connect new replicas, drop those it no longer names."""
        if self._tg is None:  # before `run`: applied when it starts
            self._pending = replicas
            return
        self.announced = replicas is not None
        wanted = {r.name: r for r in replicas} if replicas is not None else {}
        if replicas is None and not self.replicas:
            wanted = {"actor": ReplicaRef("actor", self.default_address, 0)}
        elif replicas is None:
            return
        for name, replica in list(self.replicas.items()):
            if name not in wanted or wanted[name].address != replica.address:
                replica.listed = False
                if not replica.client.stats.live or name in wanted:
                    self._close(name)
        for ref in wanted.values():
            known = self.replicas.get(ref.name)
            if known is None:
                self._connect(ref)
            else:
                known.listed, known.epoch = True, ref.epoch
        self._notify()

    def _connect(self, ref: ReplicaRef) -> None:
        assert self._tg is not None
        channel = open_channel(
            "dealer",
            ref.address,
            bind=False,
            cfg=self.transport,
            keys=self.keys,
            recv_queue=4096,
            monitor_events=ActorClient.MONITOR_EVENTS,
        )
        client = ActorClient(channel, self.worker, self.deadlines)
        client.on_change = lambda: self._on_connection(ref.name)
        replica = _Replica(ref.name, ref.address, ref.epoch, client)
        before = self.gone.pop(ref.name, None)
        if before is not None:  # the same replica again: its counts go on
            replica.requests, replica.tokens = before["requests"], before["tokens"]
            replica.refusals, replica.lost = before["refusals"], before["lost"]
            replica.failed.update({Cause(k): v for k, v in before["failed"].items()})
        self.replicas[ref.name] = replica
        self._tg.start_soon(self._serve_replica, replica, channel)
        log.info("%s: routing to replica %s at %s", self.worker, ref.name, ref.address)

    async def _serve_replica(self, replica: _Replica, channel: Channel) -> None:
        with replica.scope:
            async with anyio.create_task_group() as tg:
                tg.start_soon(channel.run)
                tg.start_soon(replica.client.run)
                tg.start_soon(replica.client.watch_connection)
        if channel.monitor is not None:  # watch_connection closes it, if it ever started
            channel.monitor.close(linger=0)
        channel.sock.close(linger=0)

    def _close(self, name: str) -> None:
        replica = self.replicas.pop(name)
        replica.client._actor_lost()  # live turns (a replaced address's) are retried elsewhere
        replica.scope.cancel()
        self.gone[name] = replica.statistics()
        self._closed_totals.update(_counters(replica.client.statistics(), levels=False))
        log.info("%s: closed the connection to replica %s", self.worker, name)

    def _on_connection(self, name: str) -> None:
        replica = self.replicas.get(name)
        if replica is not None and not replica.client.connected and self.announced:
            replica.blocked_at = replica.epoch  # until the learner re-attaches it
            replica.lost += 1
        self._notify()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()

    def usable(self, replica: _Replica) -> bool:
        if not self.announced:
            return True  # the configured actor: ZeroMQ queues for it while it is away
        blocked = replica.blocked_at is not None and replica.epoch <= replica.blocked_at
        return replica.listed and replica.client.connected and not blocked

    # --- routing ------------------------------------------------------------------------------

    def _pick_now(self, affinity: str | None) -> _Replica | None:
        """The episode's own replica when it can take the turn now (most turns), else None."""
        sticky = self.replicas.get(self._sticky.get(affinity, "")) if affinity else None
        if sticky is not None and self.usable(sticky) and now() >= sticky.shed_until:
            return sticky
        return None

    async def _pick(self, affinity: str | None, deadline: float) -> _Replica:
        """The episode's replica if it is usable, else the least loaded usable one (not shed if
        any is not); waits for one until `deadline`."""
        while True:
            own = self._pick_now(affinity)
            if own is not None:
                return own
            had = affinity is not None and self._sticky.get(affinity) in self.replicas
            candidates = [r for r in self.replicas.values() if self.usable(r)]
            if candidates:
                at = now()
                fresh = [r for r in candidates if at >= r.shed_until] or candidates
                chosen = min(fresh, key=lambda r: r.load())
                if affinity is not None:
                    if had:
                        self.moved += 1
                    self._sticky[affinity] = chosen.name
                return chosen
            changed = self._changed
            with anyio.move_on_after(max(0.0, deadline - now())):
                await changed.wait()
            if now() >= deadline:
                raise GenerationFailed(
                    Cause.ACTOR_TIMEOUT, "no actor replica was available in time", retryable=False
                )

    def release(self, affinity: str) -> None:
        self._sticky.pop(affinity, None)

    async def generate(
        self,
        prompt_token_ids: list[int],
        sampling: Sampling,
        *,
        seed: int | None,
        retry: Retry = NO_RETRY,
        affinity: str | None = None,
    ) -> Generation:
        """As `ActorClient.generate`, on the episode's replica; a retry may go to another.

        The retry loop is written out rather than `with_retries` with closures: this is every
        turn's path, and each coroutine level costs on every wake-up of the episode.
        """
        for attempt in range(retry.retries + 1):
            replica = self._pick_now(affinity)
            if replica is None:
                replica = await self._pick(affinity, now() + sampling.timeout_s)
            replica.requests += 1
            started = now()
            try:
                gen = await replica.client.generate_once(prompt_token_ids, sampling, seed=seed)
            except GenerationFailed as exc:
                replica.failed[exc.cause] += 1
                if not retry.allows(exc, attempt):
                    raise
                self.retries_by_cause[exc.cause] += 1
                await self._before_retry(replica, exc.cause, retry.delay(attempt))
                continue
            replica.tokens += len(gen.token_ids)
            self.completed += 1
            took = now() - started
            replica.latency.add(took)
            self.latency.add(took)
            return gen
        raise AssertionError("unreachable: the last try returns or raises")

    async def _before_retry(self, replica: _Replica, cause: Cause, backoff_s: float) -> None:
        """Overloaded: pass the replica over for a moment (no wait if another is usable); lost:
        retry at once (the pick waits for a usable replica); timed out: back off."""
        if cause == Cause.ACTOR_OVERLOADED:
            replica.refusals += 1
            replica.shed_until = now() + SHED_S
            others = [r for r in self.replicas.values() if r is not replica and self.usable(r)]
            if others:
                return
        elif cause == Cause.ACTOR_LOST:
            return
        else:  # timed out: a hung replica; the retry goes elsewhere if it can
            replica.shed_until = now() + SHED_S
        await anyio.sleep(backoff_s)

    async def handshake(self, *, timeout_s: float, retries: int, backoff_s: float) -> ActorInfo:
        """The first usable replica's `ActorInfo` (model, context length), as ActorClient's."""
        wait_s = timeout_s * (retries + 1) + backoff_s * 2 ** (retries + 1)
        try:
            replica = await self._pick(None, now() + wait_s)
        except GenerationFailed:
            raise ActorUnreachable(f"no actor replica became available in {wait_s:.0f}s") from None
        self.info = await replica.client.handshake(timeout_s=timeout_s, retries=retries, backoff_s=backoff_s)
        return self.info

    # --- statistics ---------------------------------------------------------------------------

    def take_latency(self) -> LatencyHistogram:
        latency, self.latency = self.latency, LatencyHistogram()
        return latency

    def statistics(self) -> dict[str, Any]:
        """The clients' counters summed over replicas, and each replica's own."""
        totals = Counter(self._closed_totals)
        for replica in self.replicas.values():
            totals.update(_counters(replica.client.statistics()))
        return {
            **totals,
            "retries_by_cause": {str(k): v for k, v in self.retries_by_cause.items()},
            "episodes_moved": self.moved,
            "deadlines": self.deadlines.statistics(),
            "replicas": {**self.gone, **{n: r.statistics() for n, r in self.replicas.items()}},
        }

    def socket_counters(self) -> dict[str, Any]:
        totals: Counter[str] = Counter()
        for replica in self.replicas.values():
            totals.update(replica.client.channel.statistics().counters())
        return dict(totals)


def _counters(stats: dict[str, Any], levels: bool = True) -> dict[str, int]:
    """The numbers of a client's statistics that add up across replicas; `levels=False` leaves
    out what is a level now (live requests, queued deltas), not a count (a closed client's)."""
    skip = set() if levels else {"live"}
    return {k: v for k, v in stats.items() if isinstance(v, int) and k not in skip}
