"""The anyio ZeroMQ channel, on both trio and asyncio."""

import anyio
import pytest
import zmq
from helpers import keys_for

from millstream.shared.config import TransportConfig
from millstream.shared.wire import Codec, ErrorReply, GenerateRequest, ReplyCause, TokenDelta, transport
from millstream.shared.wire.keys import secure
from millstream.shared.wire.transport import open_channel

SERVER, CLIENT = keys_for("actor"), keys_for("envpool")

pytestmark = pytest.mark.anyio


@pytest.fixture(params=["trio", "asyncio"])
def anyio_backend(request):
    return request.param


async def test_router_dealer_round_trips_and_coalesces():
    cfg = TransportConfig(coalesce_max=64)
    router = open_channel("router", "tcp://127.0.0.1:0", bind=True, cfg=cfg, keys=SERVER)
    dealer = open_channel("dealer", router.address, bind=False, cfg=cfg, keys=CLIENT)
    n = 2000
    async with anyio.create_task_group() as tg:
        tg.start_soon(router.run)
        tg.start_soon(dealer.run)

        async def echo():
            async for peer, messages in router:
                for m in messages:
                    await router.send(TokenDelta(m.request_id, [len(m.prompt_token_ids)], [0.0], 7), to=peer)

        tg.start_soon(echo)
        for i in range(n):  # queued without yielding, so the writer must coalesce
            dealer.send_nowait(GenerateRequest(str(i), list(range(i % 5 + 1)), 1))
        got = {}
        with anyio.fail_after(30):
            while len(got) < n:
                _, messages = await dealer.receive()
                for m in messages:
                    got[m.request_id] = m
        tg.cancel_scope.cancel()
    assert all(got[str(i)].token_ids == [i % 5 + 1] and got[str(i)].version == 7 for i in range(n))
    stats = dealer.statistics()
    assert stats.sent_messages == n and stats.sent_frames < n / 4  # coalesced
    assert router.statistics().recv_messages == n and router.statistics().decode_errors == 0
    assert stats.send_queue_max == cfg.send_queue


async def test_malformed_frame_is_answered_and_counted():
    cfg = TransportConfig()
    router = open_channel("router", "tcp://127.0.0.1:0", bind=True, cfg=cfg, keys=SERVER)
    raw = zmq.Context.instance().socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    secure(raw, CLIENT, bind=False)
    raw.connect(router.address)
    async with anyio.create_task_group() as tg:
        tg.start_soon(router.run)
        raw.send(b"definitely not msgpack")
        raw.send(Codec().encode([GenerateRequest("ok", [1], 1)]))
        with anyio.fail_after(10):
            _, messages = await router.receive()
        assert messages[0].request_id == "ok"
        with anyio.fail_after(10):
            while not raw.poll(0):
                await anyio.sleep(0.01)
        (reply,) = Codec().decode(raw.recv())
        assert isinstance(reply, ErrorReply) and reply.cause == "malformed_frame"
        assert router.statistics().decode_errors == 1
        tg.cancel_scope.cancel()
    raw.close()


async def test_push_pull_flush_delivers_everything():
    cfg = TransportConfig()
    pull = open_channel("pull", "tcp://127.0.0.1:0", bind=True, cfg=cfg, keys=SERVER)
    push = open_channel("push", pull.address, bind=False, cfg=cfg, keys=CLIENT)
    async with anyio.create_task_group() as tg:
        tg.start_soon(pull.run)
        tg.start_soon(push.run)
        for i in range(500):
            await push.send(ErrorReply(ReplyCause.MALFORMED_FRAME, str(i)))
        assert await push.flush(timeout=10)
        seen = []
        with anyio.fail_after(10):
            while len(seen) < 500:
                _, messages = await pull.receive()
                seen += [int(m.message) for m in messages]
        tg.cancel_scope.cancel()
    assert seen == list(range(500))  # one PUSH socket keeps order


async def test_send_times_out_when_queue_stays_full():
    cfg = TransportConfig(send_queue=2)
    push = open_channel("push", "tcp://127.0.0.1:1", bind=False, cfg=cfg, keys=CLIENT)  # writer not running
    await push.send(ErrorReply(ReplyCause.MALFORMED_FRAME, "1"))
    await push.send(ErrorReply(ReplyCause.MALFORMED_FRAME, "2"))
    with pytest.raises(TimeoutError, match="send queue full"):
        await push.send(ErrorReply(ReplyCause.MALFORMED_FRAME, "3"), timeout=0.2)
    assert push.statistics().send_queue == 2
    push.sock.close(linger=0)


def test_unknown_kind_is_an_error():
    with pytest.raises(ValueError, match="unknown socket kind"):
        open_channel("pair", "tcp://127.0.0.1:0", bind=True, cfg=TransportConfig(), keys=SERVER)


def test_channel_without_keys_needs_curve_off():
    with pytest.raises(ValueError, match="transport.curve is on but no keys"):
        open_channel("router", "tcp://127.0.0.1:0", bind=True, cfg=TransportConfig(), keys=None)
    plain = open_channel("pull", "tcp://127.0.0.1:0", bind=True, cfg=TransportConfig(curve=False), keys=None)
    assert not plain.authenticated
    plain.sock.close(linger=0)


def _outsider(kind: int, address: str, keys: str) -> zmq.Socket:
    """A socket of a process that is not the run's: no CURVE, or CURVE with a key of its own."""
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    if keys == "own":
        public, secret = zmq.curve_keypair()
        sock.curve_publickey, sock.curve_secretkey = public, secret
        sock.curve_serverkey = SERVER.server_public  # it even knows the server's public key
    if kind == zmq.SUB:
        sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.connect(address)
    return sock


async def test_curve_admits_the_run_keys_only_and_names_the_role():
    """An outsider's request never reaches the router and an outsider's SUB reads nothing; the
    run's client gets through and the router knows which role it authenticated as."""
    cfg = TransportConfig()
    router = open_channel("router", "tcp://127.0.0.1:0", bind=True, cfg=cfg, keys=SERVER)
    pub = open_channel("pub", "tcp://127.0.0.1:0", bind=True, cfg=cfg, keys=SERVER)
    friend = open_channel("dealer", router.address, bind=False, cfg=cfg, keys=keys_for("learner"))
    forged = Codec().encode([GenerateRequest("forged", [1, 2], 1)])
    outsiders = [_outsider(zmq.DEALER, router.address, k) for k in ("none", "own")]
    listeners = [_outsider(zmq.SUB, pub.address, k) for k in ("none", "own")]
    async with anyio.create_task_group() as tg:
        for channel in (router, pub, friend):
            tg.start_soon(channel.run)
        for sock in outsiders:
            sock.send(forged)
        await friend.send(GenerateRequest("friend", [3], 1))
        with anyio.fail_after(10):
            peer, messages = await router.receive()
        assert [m.request_id for m in messages] == ["friend"]
        assert router.peer_role(peer) == "learner"
        for _ in range(20):  # 1 s of versions published; nothing may reach the outsiders
            await pub.send(ErrorReply(ReplyCause.MALFORMED_FRAME, "version"))
            await anyio.sleep(0.05)
        with anyio.move_on_after(1.0):
            peer, messages = await router.receive()
            pytest.fail(f"an outsider got through: {messages}")
        tg.cancel_scope.cancel()
    assert not any(sock.poll(0) for sock in listeners)
    assert router.statistics().recv_messages == 1
    for sock in outsiders + listeners:
        sock.close()


async def test_the_roles_of_peers_gone_are_forgotten_past_a_bound(monkeypatch):
    """A CURVE ROUTER remembers which role each peer identity authenticated as; a reconnecting
    peer comes back under a new identity, so past MAX_PEER_ROLES the one silent longest is
    forgotten, never one that just spoke."""
    monkeypatch.setattr(transport, "MAX_PEER_ROLES", 2)
    cfg = TransportConfig()
    router = open_channel("router", "tcp://127.0.0.1:0", bind=True, cfg=cfg, keys=SERVER)
    roles = ["learner", "envpool", "envpool"]
    peers = [open_channel("dealer", router.address, bind=False, cfg=cfg, keys=keys_for(r)) for r in roles]
    seen = {}
    async with anyio.create_task_group() as tg:
        for channel in (router, *peers):
            tg.start_soon(channel.run)
        for i in (0, 1, 0, 2):  # the learner speaks again before the third peer's first word
            await peers[i].send(GenerateRequest(str(i), [1], 1))
            with anyio.fail_after(10):
                who, _ = await router.receive()
            assert router.peer_role(who) == roles[i]  # known when its message came
            seen[i] = who
        tg.cancel_scope.cancel()
    assert len(router._roles) == 2  # the bound, not one entry per identity ever seen
    assert router.peer_role(seen[0]) == "learner"  # spoke second to last: kept
    assert router.peer_role(seen[1]) is None  # silent longest: forgotten


async def test_a_peer_that_stops_reading_does_not_hold_the_other_peers_replies(monkeypatch):
    """A ROUTER's frames to a frozen peer wait behind its full pipe; past STALLED_PEER_S they are
    dropped (counted) so that the replies to every other peer go out."""
    monkeypatch.setattr(transport, "STALLED_PEER_S", 0.5)
    cfg = TransportConfig(high_water_mark=2, coalesce_max=1)
    router = open_channel("router", "tcp://127.0.0.1:0", bind=True, cfg=cfg, keys=SERVER)
    live = open_channel("dealer", router.address, bind=False, cfg=cfg, keys=CLIENT)
    frozen = zmq.Context.instance().socket(zmq.DEALER)  # one of the run's; it never reads
    frozen.setsockopt(zmq.LINGER, 0)
    frozen.setsockopt(zmq.RCVHWM, 1)
    secure(frozen, CLIENT, bind=False)
    frozen.connect(router.address)
    big = TokenDelta("frozen", [100_000] * 50_000, [0.5] * 50_000, 1)  # about 0.7 MB a message
    async with anyio.create_task_group() as tg:
        tg.start_soon(router.run)
        tg.start_soon(live.run)
        frozen.send(Codec().encode([GenerateRequest("frozen", [1], 1)]))
        with anyio.fail_after(10):
            stuck, _ = await router.receive()
        for _ in range(1000):  # until the socket buffers and the pipe are full, whatever their size
            await router.send(big, to=stuck)
            await anyio.sleep(0.01)
            if router.statistics().dropped_frames:
                break
        await live.send(GenerateRequest("live", [1], 1))
        with anyio.fail_after(20):
            peer, _ = await router.receive()
            await router.send(TokenDelta("live", [1], [0.0], 1), to=peer)
            _, messages = await live.receive()
        tg.cancel_scope.cancel()
    assert [m.request_id for m in messages] == ["live"]
    assert router.statistics().dropped_frames > 0
    frozen.close()


async def test_batches_are_split_into_frames_the_peer_accepts():
    """With a frame limit the writer sends a big batch as several frames, each within it, and
    nothing is lost; the receiver holds the same limit (MAXMSGSIZE)."""
    cfg = TransportConfig(coalesce_max=512, max_frame_bytes=20_000)
    router = open_channel("router", "tcp://127.0.0.1:0", bind=True, cfg=cfg, keys=SERVER)
    dealer = open_channel("dealer", router.address, bind=False, cfg=cfg, keys=CLIENT)
    assert router.sock.getsockopt(zmq.MAXMSGSIZE) == 20_000
    n = 400
    async with anyio.create_task_group() as tg:
        tg.start_soon(router.run)
        tg.start_soon(dealer.run)
        for i in range(n):  # ~400 bytes each: one batch of 160 kB without the split
            dealer.send_nowait(GenerateRequest(str(i), list(range(1000, 1100)), 1))
        got: set[str] = set()
        with anyio.fail_after(30):
            while len(got) < n:
                _, messages = await router.receive()
                got |= {m.request_id for m in messages}
        tg.cancel_scope.cancel()
    stats = dealer.statistics()
    assert got == {str(i) for i in range(n)} and stats.sent_frames >= 8
    assert stats.sent_bytes / stats.sent_frames <= 20_000


def test_a_single_message_over_the_limit_is_a_config_error():
    from millstream.shared.config import ConfigError

    cfg = TransportConfig(max_frame_bytes=1000, curve=False)
    push = open_channel("push", "tcp://127.0.0.1:1", bind=False, cfg=cfg, keys=None)
    try:
        with pytest.raises(ConfigError, match=r"transport.max_frame_bytes = 1000: a GenerateRequest of"):
            push._payloads([GenerateRequest("x", list(range(1000, 2000)), 1)])
    finally:
        push.sock.close(0)


def test_the_frame_limit_is_derived_from_the_config_or_checked_against_it():
    from millstream.shared.config import ConfigError, load_config

    assert load_config(None, []).transport.max_frame_bytes == 16 << 20  # the floor
    long = load_config(None, ["actor.max_model_len=32768", "envpool.max_turns=50"])
    assert long.transport.max_frame_bytes == 48 * 32768 * 50 + (1 << 20)
    assert load_config(None, ["transport.max_frame_bytes=5000000"]).transport.max_frame_bytes == 5_000_000
    with pytest.raises(ConfigError, match="transport.max_frame_bytes = 1000: below"):
        load_config(None, ["transport.max_frame_bytes=1000"])
