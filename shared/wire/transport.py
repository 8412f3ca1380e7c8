"""ZeroMQ sockets driven from anyio, so the same code runs under trio and asyncio.

A `Channel` owns one ZeroMQ socket and two bounded queues, and runs two tasks:

- the *reader* drains every frame the socket holds, decodes it (`shared.wire.Codec`) and puts
  `(peer, messages)` on the inbound queue; then it sleeps until the socket's file descriptor is
  readable.
- the *writer* takes the first waiting message, then whatever else is already queued (up to
  `coalesce_max`), packs the messages for one peer into one frame and sends it.

Why not pyzmq's own asyncio sockets: they do not run under trio. Why this shape: ZeroMQ exposes one
*edge-triggered* file descriptor per socket. It signals "ZMQ_EVENTS may have changed", not "a
message is waiting", and any socket call (a send too) can consume that edge. So the reader only
sleeps after `ZMQ_EVENTS` says nothing is readable, the writer wakes the reader when a send leaves
messages pending, and every sleep is bounded by `io_wait_s` in case an edge is missed anyway.
Only the reader ever waits on the descriptor (trio allows one waiter per descriptor).

With the run's CURVE keys (`shared/wire/keys.py`, on by default) every frame is encrypted and only
the run's processes connect; a ROUTER remembers which role each peer authenticated as
(`peer_role`), so a server can take some messages from one role only.

Malformed frames are counted (`statistics().decode_errors`) and, on sockets that can answer
(ROUTER, DEALER), answered with an `ErrorReply`; the channel keeps serving.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import cast

import anyio
import msgspec
import zmq
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from millstream.shared.config import ConfigError, TransportConfig
from millstream.shared.obs.ratelog import RateLog
from millstream.shared.wire import Codec, ErrorReply, Message, Outgoing, ProtocolError, ReplyCause
from millstream.shared.wire.keys import RunKeys, secure

__all__ = ["Channel", "ChannelStats", "open_channel", "limit_socket", "KINDS"]

log = logging.getLogger(__name__)

KINDS = {
    "router": zmq.ROUTER,
    "dealer": zmq.DEALER,
    "push": zmq.PUSH,
    "pull": zmq.PULL,
    "pub": zmq.PUB,
    "sub": zmq.SUB,
}
_CAN_RECV = {"router", "dealer", "pull", "sub"}
_CAN_SEND = {"router", "dealer", "push", "pub"}
_CAN_ANSWER = {"router", "dealer"}


@dataclass
class ChannelStats:
    """Counters of one channel; `*_queue` are current lengths, `*_queue_max` their bounds."""

    kind: str
    address: str
    sent_messages: int = 0
    sent_frames: int = 0
    sent_bytes: int = 0
    recv_messages: int = 0
    recv_frames: int = 0
    recv_bytes: int = 0
    decode_errors: int = 0
    send_retries: int = 0
    send_queue: int = 0
    send_queue_max: int = 0
    recv_queue: int = 0
    recv_queue_max: int = 0
    #: Frames to a ROUTER's peer that is gone, or that stopped reading (`STALLED_PEER_S`).
    dropped_frames: int = 0

    def counters(self) -> dict[str, int | str]:
        """Every counter, as a plain dict (JSON-ready)."""
        return dict(vars(self))


#: Peer identities a CURVE ROUTER remembers the role of (`peer_role`).
MAX_PEER_ROLES = 65536
#: A ROUTER's peer whose pipe stays full this long has stopped reading (`Channel._has_stalled`).
STALLED_PEER_S = 10.0
#: ... and gets no such grace again until this long after its frames were last dropped.
STALLED_MEMORY_S = 60.0


class Channel:
    """One ZeroMQ socket, its bounded queues, and the tasks that move frames.

    Use inside a task group: `tg.start_soon(channel.run)`, then `await channel.send(msg)` and
    `async for peer, messages in channel: ...`. On ROUTER sockets `peer` is the sender's identity
    and `send(msg, to=peer)` addresses a reply; elsewhere `peer` is `b""`.
    """

    def __init__(
        self,
        sock: zmq.Socket,
        kind: str,
        address: str,
        cfg: TransportConfig,
        recv_queue: int = 1024,
        *,
        authenticated: bool = False,
    ) -> None:
        self.sock = sock
        self.kind = kind
        self.address = address
        self._cfg = cfg
        self._codec = Codec()
        self._out_tx: MemoryObjectSendStream[tuple[bytes, Outgoing]]
        self._out_rx: MemoryObjectReceiveStream[tuple[bytes, Outgoing]]
        self._out_tx, self._out_rx = anyio.create_memory_object_stream(cfg.send_queue)
        self._in_tx: MemoryObjectSendStream[tuple[bytes, list[Message]]]
        self._in_rx: MemoryObjectReceiveStream[tuple[bytes, list[Message]]]
        self._in_tx, self._in_rx = anyio.create_memory_object_stream(recv_queue)
        self._read_wait: anyio.CancelScope | None = None
        self._in_hand = 0  # messages taken off the queue but not yet handed to ZeroMQ
        #: ROUTER with CURVE: the role each peer identity authenticated as (its ZAP User-Id).
        self._roles: dict[bytes, str] = {}
        self._track_roles = authenticated and kind == "router"
        #: ROUTER peers that stopped reading, and when a frame to them was last dropped.
        self._stalled: dict[bytes, float] = {}
        #: True when the socket uses the run's CURVE keys.
        self.authenticated = authenticated
        self._stats = ChannelStats(kind, address, send_queue_max=cfg.send_queue, recv_queue_max=recv_queue)
        self._bad = RateLog(log)  # a peer controls how often these happen: count, log a sample
        #: The socket's monitor when `open_channel` was asked for one (`monitor_events`).
        self.monitor: zmq.Socket | None = None

    # --- public API ------------------------------------------------------------------------

    async def send(self, message: Outgoing, to: bytes = b"", timeout: float = 60.0) -> None:
        """Queue a message (or one encoded already, `Codec.encode_one`); waits while the queue
        is full (backpressure), at most `timeout` s.

        The common case, room in the queue, takes no cancel scope and no checkpoint: at
        thousands of sends a second the scope showed in profiles, and every caller awaits
        something else right after.
        """
        try:
            self._out_tx.send_nowait((to, message))
            return
        except anyio.WouldBlock:
            pass
        try:
            with anyio.fail_after(timeout):
                await self._out_tx.send((to, message))
        except TimeoutError:
            raise TimeoutError(
                f"{self.kind} {self.address}: send queue full ({self._cfg.send_queue}) for {timeout}s"
            ) from None

    def send_nowait(self, message: Outgoing, to: bytes = b"") -> None:
        """Queue a message or raise `anyio.WouldBlock` if the queue is full."""
        self._out_tx.send_nowait((to, message))

    async def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every queued message has been handed to ZeroMQ; False on timeout."""
        with anyio.move_on_after(timeout):
            while self._out_rx.statistics().current_buffer_used or self._in_hand:
                await anyio.sleep(0.002)
            return True
        return False

    async def receive(self) -> tuple[bytes, list[Message]]:
        return await self._in_rx.receive()

    def __aiter__(self) -> AsyncIterator[tuple[bytes, list[Message]]]:
        return self._in_rx.__aiter__()

    def peer_role(self, peer: bytes) -> str | None:
        """The run role `peer` authenticated as ("learner", "envpool", ...), or None without
        CURVE (anyone who can reach the socket) or if unknown."""
        return self._roles.get(peer)

    def statistics(self) -> ChannelStats:
        self._stats.send_queue = self._out_rx.statistics().current_buffer_used
        self._stats.recv_queue = self._in_rx.statistics().current_buffer_used
        self._stats.decode_errors = self._codec.errors
        return self._stats

    async def run(self) -> None:
        """Move frames until cancelled. Closes the socket on exit."""
        try:
            async with anyio.create_task_group() as tg:
                if self.kind in _CAN_RECV:
                    tg.start_soon(self._reader)
                if self.kind in _CAN_SEND:
                    tg.start_soon(self._writer)
        finally:
            self.sock.close(linger=0)

    # --- the two tasks ---------------------------------------------------------------------

    async def _reader(self) -> None:
        sock, fd = self.sock, cast(int, self.sock.getsockopt(zmq.FD))
        while True:
            while cast(int, sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                try:
                    frames = self._recv_frames()
                except zmq.Again:
                    break
                await self._deliver(frames)
            # One scope, with the bounded wait as its deadline: the writer cancels it when a
            # send swallowed the edge (below), the deadline when an edge is missed anyway.
            with anyio.CancelScope(deadline=anyio.current_time() + self._cfg.io_wait_s) as scope:
                self._read_wait = scope
                await anyio.wait_readable(fd)
            self._read_wait = None

    def _recv_frames(self) -> list[bytes]:
        if not self._track_roles:
            return self.sock.recv_multipart(zmq.NOBLOCK, copy=True)
        # Frame objects carry the ZAP User-Id; only a ROUTER with CURVE pays for them.
        parts = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
        if len(parts) > 1:  # every frame: a routing id can pass to another peer after a reconnect
            peer, roles = parts[0].bytes, self._roles
            # A reconnecting peer comes back under a new routing id (a learner waiting for a
            # replica reconnects every 5 s), and the old one is never heard of again: past the
            # bound, the one silent longest is forgotten (each frame moves its peer to the end).
            if roles.pop(peer, None) is None and len(roles) >= MAX_PEER_ROLES:
                del roles[next(iter(roles))]
            roles[peer] = str(parts[-1].get("User-Id"))
        return [part.bytes for part in parts]

    async def _deliver(self, frames: list[bytes]) -> None:
        stats = self._stats
        stats.recv_frames += 1
        stats.recv_bytes += sum(len(f) for f in frames)
        peer = b""
        if self.kind == "router":
            peer, frames = frames[0], frames[1:]
        try:
            if len(frames) != 1:
                self._codec.errors += 1
                raise ProtocolError(f"expected 1 payload frame, got {len(frames)}")
            messages = self._codec.decode(frames[0])
        except ProtocolError as exc:
            self._bad.event("malformed_frame", "%s %s: dropped a bad frame: %s", self.kind, self.address, exc)
            if self.kind in _CAN_ANSWER:
                try:
                    self.send_nowait(ErrorReply(ReplyCause.MALFORMED_FRAME, str(exc)[:500]), to=peer)
                except anyio.WouldBlock:
                    pass
            return
        stats.recv_messages += len(messages)
        await self._in_tx.send((peer, messages))

    async def _writer(self) -> None:
        cfg, out = self._cfg, self._out_rx
        while True:
            first = await out.receive()
            batch: dict[bytes, list[Outgoing]] = {first[0]: [first[1]]}
            count = 1
            while count < cfg.coalesce_max:
                try:
                    to, message = out.receive_nowait()
                except anyio.WouldBlock:
                    break
                batch.setdefault(to, []).append(message)
                count += 1
            self._in_hand = count
            for to, messages in batch.items():
                for payload, count in self._payloads(messages):
                    frames = [to, payload] if self.kind == "router" else [payload]
                    if await self._send_frames(frames):
                        self._stats.sent_messages += count
                        self._stats.sent_frames += 1
                        self._stats.sent_bytes += len(payload)
            self._in_hand = 0

    def _has_stalled(self, peer: bytes, since: float) -> bool:
        """A ROUTER's frames to one peer wait behind its full pipe, and every other peer's
        replies wait behind them: a peer that has not read for `STALLED_PEER_S` (a frozen
        worker; at the default high-water mark, 100,000 frames behind) gets what does not fit
        in its pipe dropped, counted, and for `STALLED_MEMORY_S` after its last drop it gets no
        such grace again (a peer that reads in bursts would hold the others each time). Its
        requests then fail, not end short: a delta after a lost one names a gap
        (`TokenDelta.offset`, retried as `actor_gap`), and one that never comes is a turn
        timeout."""
        now, last = anyio.current_time(), self._stalled.pop(peer, None)
        if (last is None or now - last > STALLED_MEMORY_S) and now - since < STALLED_PEER_S:
            return False
        if len(self._stalled) >= MAX_PEER_ROLES:  # bounded, as the roles are
            del self._stalled[next(iter(self._stalled))]
        self._stalled[peer] = now
        self._stats.dropped_frames += 1
        self._bad.event("peer_stalled", "%s: a peer stopped reading, dropped a frame to it", self.address)
        return True

    def _payloads(self, messages: list[Outgoing]) -> list[tuple[bytes, int]]:
        """`messages` encoded in frames the peer accepts (`transport.max_frame_bytes`): one
        frame, or halves of the batch until each fits. A single message over the limit means the
        limit is wrong for this config: a ConfigError (the role stops and says so)."""
        payload = self._codec.encode(messages)
        limit = self._cfg.max_frame_bytes
        if not limit or len(payload) <= limit:
            return [(payload, len(messages))]
        if len(messages) == 1:
            one = messages[0]
            kind = type(self._codec.decode_one(one) if isinstance(one, msgspec.Raw) else one).__name__
            raise ConfigError(
                f"transport.max_frame_bytes = {limit}: a {kind} of "
                f"{len(payload)} bytes does not fit (its peer would drop the connection); raise it"
            )
        half = len(messages) // 2
        return self._payloads(messages[:half]) + self._payloads(messages[half:])

    async def _send_frames(self, frames: list[bytes]) -> bool:
        """Send one frame; False if it was dropped (its peer is gone, or stopped reading)."""
        delay, started = 0.0005, None  # the clock is read only once a send has to wait
        while True:
            try:
                self.sock.send_multipart(frames, zmq.NOBLOCK, copy=False)
                break
            except zmq.Again:
                # High-water mark reached (or, on a DEALER, no peer yet): back off, bounded.
                started = anyio.current_time() if started is None else started
                if self.kind == "router" and self._has_stalled(frames[0], started):
                    return False
                self._stats.send_retries += 1
                await anyio.sleep(delay)
                delay = min(delay * 2, self._cfg.io_wait_s)
            except zmq.ZMQError as exc:
                if exc.errno == zmq.EHOSTUNREACH:  # ROUTER: that peer is gone; drop its frame.
                    self._stalled.pop(frames[0], None)
                    self._stats.dropped_frames += 1
                    self._bad.event("peer_gone", "%s: peer gone, dropped a frame", self.address)
                    return False
                raise
        # A send can swallow the descriptor's edge; wake the reader if frames are waiting.
        if self._read_wait is not None and cast(int, self.sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
            self._read_wait.cancel()
        return True


def limit_socket(sock: zmq.Socket, cfg: TransportConfig) -> None:
    """Bound what one peer can make this socket hold: a frame over `transport.max_frame_bytes`
    closes that connection unread (libzmq checks a frame's declared size against MAXMSGSIZE
    before it buffers it, the CURVE handshake's own frames included, so a keyless peer
    declaring gigabytes costs nothing), and a handshake not done in `handshake_timeout_s` ends.
    Every socket of the run is set up here, before it binds or connects."""
    sock.setsockopt(zmq.MAXMSGSIZE, cfg.max_frame_bytes or -1)
    sock.setsockopt(zmq.HANDSHAKE_IVL, int(cfg.handshake_timeout_s * 1000))


def open_channel(
    kind: str,
    address: str,
    *,
    bind: bool,
    cfg: TransportConfig,
    keys: RunKeys | None,
    identity: bytes | None = None,
    recv_queue: int = 1024,
    monitor_events: int = 0,
) -> Channel:
    """Create a socket of `kind`, bind or connect it to `address`, and wrap it in a Channel.

    Binding to port 0 (`tcp://127.0.0.1:0`) picks a free port; `channel.address` tells which.
    `keys` (from `shared.wire.keys.load_keys`) makes it a CURVE server (bind) or client (connect);
    None is allowed only with `transport.curve = false`.
    `monitor_events` (ZeroMQ's EVENT_* flags): a monitor of the socket, `channel.monitor`,
    attached *before* it connects, so no event of the first connection is missed (a handshake
    over loopback can finish before the next task runs).
    """
    if cfg.curve and keys is None:
        raise ValueError(f"{kind} {address}: transport.curve is on but no keys were given")
    if kind not in KINDS:
        raise ValueError(f"unknown socket kind {kind!r}; expected one of {sorted(KINDS)}")
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(KINDS[kind])
    limit_socket(sock, cfg)
    sock.setsockopt(zmq.SNDHWM, cfg.high_water_mark)
    sock.setsockopt(zmq.RCVHWM, cfg.high_water_mark)
    sock.setsockopt(zmq.LINGER, 2000)
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity)
    if kind == "router":
        # Fail loudly on a reply to a vanished peer instead of dropping it silently.
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    if kind == "sub":
        sock.setsockopt(zmq.SUBSCRIBE, b"")
    secure(sock, keys, bind=bind)
    monitor = sock.get_monitor_socket(monitor_events) if monitor_events else None
    if bind:
        sock.bind(address.replace(":0", ":*") if address.endswith(":0") else address)
        address = sock.getsockopt_string(zmq.LAST_ENDPOINT)
    else:
        sock.connect(address)
    channel = Channel(sock, kind, address, cfg, recv_queue=recv_queue, authenticated=keys is not None)
    channel.monitor = monitor
    return channel
