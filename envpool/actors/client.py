"""The envpool side of the actor connection: many episodes, one DEALER socket.

Every episode task calls `client.generate(...)`; all of them share one socket, one reader task
and one writer task (`shared.wire.transport.Channel`), which packs the requests of a tick into one
frame. Replies are routed by request id into the request's `PendingRequest` record
(envpool/actors/pending.py), which collects the generation and wakes its episode once, when the
request ends.

Turn deadlines are kept by a timer wheel (envpool/deadlines.py, `client.deadlines`), not by a
cancel scope per request: at thousands of turns a second the scopes' deadline heap was a large
share of a worker's CPU. A request past its deadline is failed as `actor_timeout` by the wheel,
the way a dropped connection fails it as `actor_lost`. The wheel is the client's own (run by
`run()`), or the router's, which all its replicas' clients share.

Request ids are `<worker>-<counter>`, so they never repeat within a worker and a late reply for a
finished request is recognised and counted (`late_replies`), never delivered to the wrong episode.

A generation either ends with a final delta (finish_reason set) or raises `GenerationFailed`
with its `shared.wire.Cause`: the actor's `GenerateError`, a timeout, an abort the envpool did
not ask for, or an actor that breaks the protocol. An episode cancelled while it waits (it timed
out, or the run ends) sends `Abort`, so the actor stops spending compute on it.

The reply router is an error boundary: a delta that breaks the protocol (token ids and logprobs
of different lengths, an unknown finish reason, a negative version, more tokens than the request
asked for) fails only its own request as `actor_protocol`, counted in `protocol_errors`; a reply
the client does not expect is counted and a sample logged (`shared/obs/ratelog.py`). Nothing an actor
sends ends the worker.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import anyio
import zmq
from zmq.utils.monitor import recv_monitor_message

from millstream.envpool.actors.generation import (
    NO_RETRY,
    Generation,
    GenerationFailed,
    Retry,
    Sampling,
    with_retries,
)
from millstream.envpool.actors.pending import PendingRequest
from millstream.envpool.deadlines import NEVER, Deadlines, now
from millstream.shared.obs.metrics import LatencyHistogram
from millstream.shared.obs.ratelog import RateLog
from millstream.shared.wire import (
    TURN_CAUSE,
    Abort,
    ActorInfo,
    Cause,
    Codec,
    ErrorReply,
    GenerateError,
    GenerateRequest,
    Hello,
    TokenDelta,
)
from millstream.shared.wire.transport import Channel

__all__ = ["ActorClient", "ActorUnreachable", "Generation", "GenerationFailed", "ClientStats", "TurnClient"]

log = logging.getLogger(__name__)


class ActorUnreachable(RuntimeError):
    """The actor never answered the handshake."""


@dataclass
class ClientStats:
    requests: int = 0
    live: int = 0
    completed: int = 0
    failed: int = 0
    aborted: int = 0
    late_replies: int = 0
    error_replies: int = 0
    #: Replies that broke the protocol (each fails its request as actor_protocol).
    protocol_errors: int = 0
    #: Replies of a kind the client does not take.
    unexpected_replies: int = 0
    retries: int = 0
    #: Times the connection to the actor dropped (its live turns were retried).
    disconnects: int = 0
    #: Request-to-final-delta time of completed generations (turn latency as the env sees it).
    latency: LatencyHistogram = field(default_factory=LatencyHistogram, repr=False)


class TurnClient(Protocol):
    """What an episode needs to generate its turns: `ActorClient` (one actor) or
    `envpool.actors.router.Router` (the run's replicas)."""

    async def generate(
        self,
        prompt_token_ids: list[int],
        sampling: Sampling,
        *,
        seed: int | None,
        retry: Retry = NO_RETRY,
        affinity: str | None = None,
    ) -> Generation: ...


class ActorClient:
    """Multiplexes generation requests of many tasks over one DEALER `Channel`.

    Run `client.run()` in a task group; it reads replies and adds them to each live request's
    `PendingRequest` record. The router never waits on an episode, so a slow episode cannot stall the
    others; an actor that sends a request more tokens than its `max_tokens` gets that request
    failed as `actor_protocol`, which bounds memory.

    `deadlines`: a wheel someone else runs (the router's); None gives the client its own, which
    `run()` runs.
    """

    #: What `watch_connection` reads; open the channel with `monitor_events=MONITOR_EVENTS` so
    #: that the first handshake cannot pass before the monitor exists (`connected` would stay
    #: False, and the router would never use the replica).
    MONITOR_EVENTS = zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED

    def __init__(self, channel: Channel, worker: str, deadlines: Deadlines | None = None) -> None:
        self.channel = channel
        self.worker = worker
        self.deadlines = deadlines or Deadlines()
        self._runs_deadlines = deadlines is None
        self._ids = itertools.count()
        self._routes: dict[str, PendingRequest] = {}
        self._codec = Codec()  # requests are encoded as they are sent (`_send_request`)
        self.stats = ClientStats()
        self.info: ActorInfo | None = None
        self._info_event = anyio.Event()
        self._bad = RateLog(log)
        #: True while the connection is up (its handshake succeeded, it has not dropped since).
        self.connected = False
        #: Requests other clients held on the actor at its last final delta (what the actor
        #: reported, less this client's own): the router's view of the actor's load.
        self.others_load = 0
        #: Called on every connection change (the router re-routes).
        self.on_change: Callable[[], None] = lambda: None

    async def run(self) -> None:
        """Route replies until cancelled (and run the client's own deadlines, if it has them)."""
        if not self._runs_deadlines:
            await self._route_replies()
            return
        async with anyio.create_task_group() as tg:
            tg.start_soon(self.deadlines.run)
            await self._route_replies()
            tg.cancel_scope.cancel()

    async def _route_replies(self) -> None:
        async for _, messages in self.channel:
            for message in messages:
                if isinstance(message, (TokenDelta, GenerateError)):
                    self._take_reply(message)
                elif isinstance(message, ActorInfo):
                    self.info = message
                    self._info_event.set()
                elif isinstance(message, ErrorReply):
                    # The actor could not read one of our frames: a bug worth shouting about.
                    self.stats.error_replies += 1
                    cause, text = message.cause, message.message
                    self._bad.event("error_reply", "actor rejected a frame: %s: %s", cause, text)
                else:
                    self.stats.unexpected_replies += 1
                    self._bad.event("unexpected", "unexpected %s from the actor", type(message).__name__)

    def _take_reply(self, reply: TokenDelta | GenerateError) -> None:
        """One reply into its request's record; a reply that breaks the protocol fails only it."""
        pending = self._routes.get(reply.request_id)
        if pending is None or pending.finished:
            self.stats.late_replies += 1  # the request ended already (finished, failed, or its episode gone)
            return
        if isinstance(reply, GenerateError):
            pending.fail(GenerationFailed(TURN_CAUSE[reply.cause], reply.message))
            return
        problem = _delta_problem(reply)
        out = pending.out
        if problem is None and reply.offset >= 0 and reply.offset != len(out.token_ids):
            # Not a broken actor: it dropped a delta to this worker (its queue stayed full, or we
            # had stopped reading). The turn cannot end whole; it is retried (`actor_gap`).
            gap = f"a delta at token {reply.offset} after {len(out.token_ids)} tokens: one was lost"
            self._bad.event("actor_gap", "request %s: %s", reply.request_id, gap)
            pending.fail(GenerationFailed(Cause.ACTOR_GAP, gap))
            return
        if problem is None and len(out.token_ids) + len(reply.token_ids) > pending.max_tokens:
            problem = (
                f"{len(out.token_ids) + len(reply.token_ids)} tokens for max_tokens={pending.max_tokens}"
            )
        if problem is not None:
            self.stats.protocol_errors += 1
            self._bad.event("actor_protocol", "request %s: %s", reply.request_id, problem)
            pending.fail(GenerationFailed(Cause.ACTOR_PROTOCOL, problem))
            return
        if reply.token_ids:
            if out.first_token_s is None:
                out.first_token_s = now() - pending.sent_at
            out.token_ids += reply.token_ids
            out.logprobs += reply.logprobs
            if reply.top_logprobs:
                out.top_logprobs += reply.top_logprobs
            out.versions += [reply.version] * len(reply.token_ids)
        if reply.finish_reason is not None:
            out.finish_reason = reply.finish_reason
            if reply.load >= 0:  # the actor's live requests, ours among them
                self.others_load = max(0, reply.load - self.stats.live)
            pending.end()

    async def watch_connection(self, every_s: float = 0.1) -> None:
        """Fail every live turn as `actor_lost` (retryable) when the connection to the actor
        drops: they died with the actor's process, and waiting out `turn_timeout_s` for each
        would stall every episode for minutes. Their retries go to another replica, or wait
        until this one is back (envpool/actors/router.py). Reads the socket's monitor (ZeroMQ's
        connection events), which also says when the connection is up (`connected`)."""
        monitor = self.channel.monitor or self.channel.sock.get_monitor_socket(self.MONITOR_EVENTS)
        try:
            while True:
                while monitor.poll(0):
                    event = recv_monitor_message(monitor)["event"]
                    self.connected = event == zmq.EVENT_HANDSHAKE_SUCCEEDED
                    if not self.connected:
                        self._actor_lost()
                    self.on_change()
                await anyio.sleep(every_s)
        finally:
            self.channel.sock.disable_monitor()
            monitor.close(linger=0)

    def _actor_lost(self) -> None:
        self.stats.disconnects += 1
        for pending in self._routes.values():
            pending.fail(GenerationFailed(Cause.ACTOR_LOST, "the connection to the actor dropped"))
        if self._routes:
            log.warning(
                "%s: the actor's connection dropped; retrying %d turns", self.worker, len(self._routes)
            )

    def take_latency(self) -> LatencyHistogram:
        """The turn latencies recorded since the last call (a fresh histogram starts)."""
        latency, self.stats.latency = self.stats.latency, LatencyHistogram()
        return latency

    def statistics(self) -> dict:
        """Counters, and the client's deadlines (pending, fired)."""
        counters = {k: v for k, v in vars(self.stats).items() if k != "latency"}
        if self._runs_deadlines:
            counters["deadlines"] = self.deadlines.statistics()
        return counters

    async def handshake(self, *, timeout_s: float, retries: int, backoff_s: float) -> ActorInfo:
        """Say `Hello` until the actor answers; raises `ActorUnreachable` after `retries` more tries.

        ZeroMQ connects in the background and queues what is sent meanwhile, so an actor that is
        down looks exactly like a slow one: only an answer proves it is there. Each try waits
        `timeout_s`; the pause between tries doubles from `backoff_s`.
        """
        for attempt in range(retries + 1):
            self._info_event = anyio.Event()
            await self.channel.send(Hello(self.worker))
            with anyio.move_on_after(timeout_s):
                await self._info_event.wait()
                assert self.info is not None
                return self.info
            if attempt < retries:
                log.warning(
                    "%s: no answer from the actor in %.1fs (try %d of %d)",
                    self.worker,
                    timeout_s,
                    attempt + 1,
                    retries + 1,
                )
                self.stats.retries += 1
                await anyio.sleep(backoff_s * 2**attempt)
        hint = " (with transport.curve on it must use this run's keys: transport.keys_dir)"
        raise ActorUnreachable(
            f"the actor did not answer Hello in {retries + 1} tries of {timeout_s}s each"
            f"{hint if self.channel.authenticated else ''}"
        )

    async def generate(
        self,
        prompt_token_ids: list[int],
        sampling: Sampling,
        *,
        seed: int | None,
        retry: Retry = NO_RETRY,
        affinity: str | None = None,
    ) -> Generation:
        """Request a generation and collect its stream; raises `GenerationFailed`.

        `affinity` (the episode) matters to the router only: one actor serves every episode.
        Failed requests are sent again as `retry` says (envpool/actors/generation.py).
        """

        async def count_and_wait(_: GenerationFailed, delay_s: float) -> None:
            self.stats.retries += 1
            await anyio.sleep(delay_s)

        return await with_retries(
            lambda: self.generate_once(prompt_token_ids, sampling, seed=seed), retry, count_and_wait
        )

    async def generate_once(
        self, prompt_token_ids: list[int], sampling: Sampling, *, seed: int | None
    ) -> Generation:
        """One request, no retry: its generation, or `GenerationFailed`."""
        request_id = f"{self.worker}-{next(self._ids)}"
        sent_at = now()
        pending = self._routes[request_id] = PendingRequest(request_id, sampling, sent_at)
        self.stats.requests += 1
        self.stats.live += 1
        timer = NEVER
        try:
            timer = self.deadlines.call_at(sent_at + sampling.timeout_s, pending.time_out)
            await self._send_request(pending, prompt_token_ids, sampling, seed)
            await pending.wait()  # bounded: the deadline above ends it
            if pending.failure is not None:
                raise pending.failure
            if pending.out.finish_reason == "abort":
                raise GenerationFailed(Cause.ACTOR_ABORT, "the actor aborted the request")
            self.stats.completed += 1
            self.stats.latency.add(now() - sent_at)
            return pending.out
        except GenerationFailed as exc:
            exc.request_id, exc.partial = request_id, pending.out
            raise
        finally:
            self.deadlines.cancel(timer)
            del self._routes[request_id]
            self.stats.live -= 1
            self._settle(request_id, pending)

    async def _send_request(
        self, pending: PendingRequest, prompt_token_ids: list[int], sampling: Sampling, seed: int | None
    ) -> None:
        # Encoded here, not by the channel's writer later: the prompt is often the episode's own
        # record (`EpisodeRecord.visible`), so the request must not hold on to it once queued.
        request = self._codec.encode_one(
            GenerateRequest(
                pending.out.request_id,
                prompt_token_ids,
                sampling.max_tokens,
                sampling.temperature,
                sampling.top_p,
                seed,
                list(sampling.stop_token_ids),
                sampling.ignore_eos,
                sampling.min_tokens,
                sampling.top_logprobs,
            )
        )
        try:
            await self.channel.send(request, timeout=sampling.timeout_s)
        except TimeoutError:
            pending.time_out()  # the send queue stayed full for the whole turn

    def _settle(self, request_id: str, pending: PendingRequest) -> None:
        """Count how the request ended; one cancelled (its episode ended) or timed out tells the
        actor to stop generating for nobody."""
        if not pending.finished or pending.timed_out:
            self.stats.aborted += 1
            try:
                self.channel.send_nowait(Abort(request_id))
            except anyio.WouldBlock:
                pass
        elif pending.failure is not None or pending.out.finish_reason == "abort":
            self.stats.failed += 1


#: Finish reasons an actor may send (None: the request still runs).
FINISH_REASONS = frozenset({None, "stop", "length", "abort"})


def _delta_problem(delta: TokenDelta) -> str | None:
    """What breaks the protocol in `delta`, in words, or None."""
    if len(delta.token_ids) != len(delta.logprobs):
        return f"{len(delta.token_ids)} token ids with {len(delta.logprobs)} logprobs"
    if delta.top_logprobs and len(delta.top_logprobs) != len(delta.token_ids):
        return f"{len(delta.token_ids)} token ids with {len(delta.top_logprobs)} top-logprob lists"
    if delta.finish_reason not in FINISH_REASONS:
        return f"unknown finish reason {str(delta.finish_reason)[:40]!r}"
    if delta.version < 0:
        return f"negative policy version {delta.version}"
    return None
