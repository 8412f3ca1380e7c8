"""A hostile peer against every role: whatever one message does, it is refused or counted and the
role keeps serving (actor/boundary.py, learner/episodes/validate.py, ReplayBuffer.accept, the envpool
client's reply router, shared/obs/ratelog.py).

Each finding of the hostile-peer probe is replayed against a real process: the synthetic actor
where the engine does not matter, the vLLM actor (`real`) where it does, and a real learner
process (DeepSpeed, `real`) fed by this test playing the envpool.
"""

from __future__ import annotations

import logging
import math
import subprocess
import sys
import time

import anyio
import msgspec
import orjson
import pytest
import zmq
from helpers import (
    KEYS,
    ROOT,
    dealer,
    keys_for,
    read_episodes,
    replies,
    start_actor,
    wait_for_file,
    with_client,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from millstream.bench.kit.spawn import stop
from millstream.envpool.actors.generation import Sampling
from millstream.envpool.stats import rss_bytes
from millstream.learner.episodes.validate import EpisodeCheck
from millstream.learner.replay import ReplayBuffer
from millstream.shared.config import ActorConfig, LearnerConfig
from millstream.shared.obs.ratelog import RateLog
from millstream.shared.process.runtime import free_port
from millstream.shared.wire import (
    Abort,
    AttachLearner,
    Cause,
    Codec,
    EpisodeFailed,
    ErrorReply,
    GenerateRequest,
    GroupStarted,
    Hello,
    PolicyVersion,
    PoolDone,
    ReplyCause,
    Trajectory,
    WorkerHello,
)
from millstream.shared.wire.keys import secure

FLOOD = 70_000


# --- pure units: the rate-limited log and the learner's checks ---------------------------------


def test_ratelog_counts_everything_and_logs_a_sample(caplog):
    bad = RateLog(logging.getLogger("hostile"), first=3, every_s=3600)
    with caplog.at_level(logging.WARNING, logger="hostile"):
        for i in range(10_000):
            bad.event("malformed_frame", "bad frame %d", i)
    assert bad.counts["malformed_frame"] == 10_000
    assert len(caplog.records) == 4  # the sample of 3, then one line for the interval


def traj(gid: str, eid: str, **changes) -> Trajectory:
    base = Trajectory(
        eid, gid, 7, "noop", [1, 2, 3, 4], [0, 0, 1, 1], [0.0, 0.0, -0.5, -0.7], [-1, -1, 0, 0],
        1.0, [1.0], 1, 2, 0.1, turn_starts=[2], turn_ends=[4], anchors=["a"],
    )  # fmt: skip
    return msgspec.structs.replace(base, **changes)


def accounted(buf: ReplayBuffer) -> None:
    s = buf.statistics()
    assert (
        s["received"] == s["trained"] + sum(s["dropped"].values()) + sum(s["failed"].values()) + s["buffered"]
    )


floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([1e308, -1e308, 1e9]))
hostile_trajectory = st.builds(
    lambda g, e, size, reward, ids, versions, seed: traj(
        f"g{g}", f"e{e}", group_size=size, reward=reward, turn_rewards=[reward], token_ids=ids,
        versions=versions, seed=seed,
    ),
    st.integers(0, 40), st.integers(0, 60), st.integers(1, 3), floats,
    st.lists(st.integers(-5, 300), min_size=0, max_size=6),
    st.lists(st.integers(-3, 5), min_size=4, max_size=4),
    st.integers(0, 2),
)  # fmt: skip


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.one_of(hostile_trajectory, st.builds(
    lambda g, e, size: EpisodeFailed(f"e{e}", f"g{g}", size, Cause.ENV_ERROR, "x"),
    st.integers(0, 40), st.integers(0, 60), st.integers(1, 3),
)), max_size=60), st.integers(0, 3))  # fmt: skip
def test_random_episodes_never_raise_and_always_add_up(messages, version):
    """Random (mostly invalid) episodes go through the learner's checks and `accept`: nothing
    raises, nothing invalid is buffered, every episode is accounted for."""
    check = EpisodeCheck(LearnerConfig(reward_range=[-10.0, 10.0]), vocab=256)
    buf = ReplayBuffer(group_size=2, groups_per_batch=1, max_staleness=2, max_groups=8)
    for m in messages:
        found = check.problem(m, version=version, admitted=30)
        buf.accept(m, None if found is None else (found.reason, found.closes_slot))
        accounted(buf)
        buf.take_batch(version)
    for group in buf._complete.values():
        for t in group.trajectories:
            assert math.isfinite(t.reward) and -10 <= t.reward <= 10 and max(t.versions) <= version
    assert sum(buf.refused.values()) == buf.dropped.get("invalid_trajectory", 0)


def test_each_learner_finding_is_a_counted_refusal():
    check = EpisodeCheck(LearnerConfig(reward_range=[-10.0, 10.0]), vocab=256)
    buf = ReplayBuffer(group_size=2, groups_per_batch=1, max_staleness=2, max_groups=2)
    buf.accept(traj("g2", "ok1"))
    buf.accept(traj("g3", "ok2"))  # the buffer (max_groups=2) is full now
    cases = [  # identity first (they touch no group), then content (each closes a slot of g3)
        ("group_identity", traj("g2", "i", seed=8)),
        ("buffer_full", traj("g5", "j")),
        ("group_size", traj("g2", "a", group_size=3)),
        ("unannounced_group", traj("g99", "d", reward=1e9)),
        ("bad_group_id", traj("evil", "e")),
        ("reward_not_finite", traj("g3", "b", reward=math.nan, turn_rewards=[math.nan])),
        ("reward_out_of_range", traj("g3", "c", reward=1e308, turn_rewards=[1e308])),
        ("version", traj("g3", "f", versions=[-1, -1, 5, 5])),
        ("token_id", traj("g3", "g", token_ids=[1, 2, 3, 10**6])),
        ("lengths", traj("g3", "h", logprobs=[0.0])),
    ]
    for reason, message in cases:
        found = check.problem(message, version=0, admitted=10)
        assert buf.accept(message, None if found is None else (found.reason, found.closes_slot)) == reason
        accounted(buf)
    assert buf.refused == {r: 1 for r, _ in cases} and buf.dropped["invalid_trajectory"] == len(cases)
    assert buf.statistics()["complete_groups"] == 0  # g3 closed by a refusal: too small, dropped


def test_bookkeeping_messages_are_checked_and_never_raise():
    """The workers' own messages (GroupStarted, WorkerHello) are checked like episodes: a forged
    one cannot open its own admission, and none ends the learner."""
    from millstream.learner.episodes.intake import Intake
    from millstream.learner.episodes.workers import WorkerLedger
    from millstream.shared.config import load_config

    cfg = load_config(None, ["train.group_size=2", "envpool.workers=2"])
    buf = ReplayBuffer(group_size=2, groups_per_batch=1, max_staleness=2, max_groups=4)
    ledger = WorkerLedger(2, group_base=0, group_size=2)
    intake = Intake(cfg, buf, ledger, EpisodeCheck(LearnerConfig(), vocab=256), lambda record: None)
    hostile = [
        GroupStarted(0, "w", "not-a-group", 2),
        GroupStarted(0, "w", "g999999", 2),  # never admitted
        GroupStarted(0, "w", "g1", 10**9),  # not the run's group size (and a huge set)
        GroupStarted(7, "w", "g1", 2),  # no such worker
        WorkerHello(99, "w"),
    ]
    for message in hostile:
        intake.handle(message, None, version=0, admitted=10)
    assert ledger.open == {} and ledger.started_total == 0 and ledger.next_groups == [0, 1]
    assert intake.refusals.counts == {"bad_group_started": 4, "bad_hello": 1}
    intake.handle(GroupStarted(0, "w", "g2", 2), None, version=0, admitted=10)  # a real one is taken
    assert ledger.started_total == 2 and set(ledger.open) == {"g2"}
    intake.handle(traj("g7", "forged", reward=1e9), None, version=0, admitted=10)  # unannounced: foreign
    assert intake.foreign == 1


def test_forged_episodes_cost_counters_not_memory():
    """Episodes no worker started are refused and counted as foreign; the learner keeps no trace
    of their ids (2,000 refusals with 100 kB ids once left it 369 MB larger), so a re-send is
    counted again and the accounting still adds up. A refusal that closes a real slot is kept
    until its group finished: at most `group_size` per group in flight."""
    from millstream.learner.episodes.intake import Intake
    from millstream.learner.episodes.workers import WorkerLedger
    from millstream.shared.config import load_config

    cfg = load_config(None, ["train.group_size=2"])
    buf = ReplayBuffer(group_size=2, groups_per_batch=1, max_staleness=2, max_groups=4)
    ledger = WorkerLedger(1, group_base=0, group_size=2)
    intake = Intake(cfg, buf, ledger, EpisodeCheck(LearnerConfig(), vocab=256), lambda record: None)
    for k in range(5000):  # never admitted, then admitted but not started with a bad reward
        intake.handle(traj("g50", f"g50-forged-{k}"), None, version=0, admitted=10)
        intake.handle(traj("g3", f"g3-forged-{k}", reward=math.nan), None, version=0, admitted=10)
    intake.handle(traj("g50", "g50-forged-0"), None, version=0, admitted=10)  # sent again
    assert intake.foreign == 10_001 and buf.duplicates == 0
    assert buf.refused == {"unannounced_group": 5001, "reward_not_finite": 5000}
    # The two that closed g3's two slots were kept until g3 finished, then forgotten with it.
    assert len(buf._seen) == 0 and buf._seen.finished("g3") and buf._closed == {}
    assert buf.statistics()["received"] - intake.foreign == ledger.started_total == 0
    accounted(buf)


# --- the synthetic actor ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hostile_synthetic(tiny_model_dir, tmp_path_factory):
    """A synthetic actor of this module's own (floods must not touch the session's actors)."""
    address, proc, log = start_actor(
        tiny_model_dir, tmp_path_factory.mktemp("hostile"), "actor.kind=synthetic", timeout_s=120
    )
    yield address, proc, log
    stop(proc, grace_s=0)


async def one_generation(address: str, timeout_s: float = 30.0):
    async def body(client, _tg):
        await client.handshake(timeout_s=5, retries=2, backoff_s=0.2)
        started = time.monotonic()
        gen = await client.generate([1, 2, 3], Sampling(max_tokens=8, timeout_s=timeout_s), seed=1)
        return gen, time.monotonic() - started

    return await with_client(address, body)


FLOODS = {
    "hello": lambda i: Hello("x"),
    "abort": lambda i: Abort(f"r{i}"),
    "generate": lambda i: GenerateRequest(f"r{i}", [1, 2], 4),
    "unexpected": lambda i: PoolDone("x", 1, 1, 0),
}


@pytest.mark.parametrize("kind", sorted(FLOODS))
@pytest.mark.slow
def test_synthetic_actor_survives_a_frame_of_70000_messages(hostile_synthetic, kind):
    address, proc, _ = hostile_synthetic
    sock = dealer(address)
    sock.send(Codec().encode([FLOODS[kind](i) for i in range(FLOOD)]))
    got = replies(sock, 3.0)
    sock.close()
    assert any(isinstance(m, ErrorReply) and m.cause == ReplyCause.TOO_MANY_MESSAGES for m in got)
    # One refusal for the frame's excess, not one per message: the replies are those of the
    # messages served (a generate request's first token and its end: two deltas each) and one.
    served = ActorConfig().max_messages_per_frame
    assert sum(isinstance(m, ErrorReply) and m.cause == ReplyCause.TOO_MANY_MESSAGES for m in got) == 1
    assert len(got) <= 2 * served + 1
    assert proc.poll() is None
    gen, _ = anyio.run(one_generation, address)
    assert gen.finish_reason in ("stop", "length")


def _rss_mb(pid: int) -> float:
    return rss_bytes(pid) / (1 << 20)


def _curve_greeting() -> bytes:
    """ZMTP 3.0's greeting as a client asking for CURVE: what libzmq sends first."""
    mechanism = b"CURVE".ljust(20, b"\0")
    return b"\xff" + b"\0" * 8 + b"\x7f" + b"\x03\x00" + mechanism + b"\0" + b"\0" * 31


@pytest.mark.slow
def test_a_keyless_peer_declaring_a_huge_handshake_frame_costs_the_actor_nothing(hostile_synthetic):
    """Before any key is checked, a HELLO declaring 2 GiB: the actor closes the connection at the
    frame's header (transport.max_frame_bytes) instead of buffering what follows (it took 1.05 GB
    of the synthetic actor, and 524 MB of the vLLM actor, before)."""
    import socket
    import struct

    address, proc, _ = hostile_synthetic
    host, port = address[len("tcp://") :].rsplit(":", 1)
    before = _rss_mb(proc.pid)
    sent = 0
    with socket.create_connection((host, int(port)), timeout=10) as raw:
        raw.sendall(_curve_greeting())
        raw.recv(64)  # the server's greeting
        raw.sendall(b"\x06" + struct.pack(">Q", 2 << 30))  # a command frame, "long", of 2 GiB
        chunk = b"\0" * (1 << 20)
        try:
            while sent < 256 << 20:
                raw.sendall(chunk)
                sent += len(chunk)
        except OSError:  # closed by the actor: what should happen
            pass
    grown = _rss_mb(proc.pid) - before
    assert sent < 256 << 20, "the actor took 256 MB of a frame it should have refused"
    assert grown < 50, f"the actor grew {grown:.0f} MB"
    assert proc.poll() is None
    gen, _ = anyio.run(one_generation, address)
    assert gen.finish_reason in ("stop", "length")


@pytest.mark.slow
def test_an_oversized_frame_from_a_peer_with_keys_is_dropped_with_its_connection(hostile_synthetic):
    """After authentication too (the envpool's key): a 100 MB frame (it took the actor to 1.2 GB
    before it was refused) ends that connection; the actor keeps its memory and serves."""
    address, proc, _ = hostile_synthetic
    before = _rss_mb(proc.pid)
    sock = dealer(address)
    sock.send(b"\0" * (100 << 20))
    assert replies(sock, 2.0) == []  # nothing decoded, nothing answered: the frame never arrived
    sock.close()
    grown = _rss_mb(proc.pid) - before
    assert grown < 50, f"the actor grew {grown:.0f} MB"
    gen, _ = anyio.run(one_generation, address)
    assert gen.finish_reason in ("stop", "length")


@pytest.mark.slow
def test_bad_frames_are_counted_and_logged_at_a_bounded_rate(hostile_synthetic):
    address, proc, log = hostile_synthetic
    before = log.stat().st_size
    sock = dealer(address)
    for i in range(10_000):
        sock.send(b"\xc1garbage" + i.to_bytes(4, "little"))
    got = replies(sock, 3.0)
    sock.close()
    assert sum(isinstance(m, ErrorReply) for m in got) > 0 and proc.poll() is None
    assert log.stat().st_size - before < 20_000  # was 1.4-1.7 MB per 10,000 bad frames


def closed_port_attach(address: str, timeout_s: float) -> zmq.Socket:
    sock = dealer(address, role="learner")  # the envpool's key may not attach at all
    sock.send(Codec().encode([AttachLearner("evil", "127.0.0.1", free_port(), 2, "gloo", timeout_s)]))
    return sock


@pytest.mark.slow
def test_attach_to_a_closed_port_does_not_stall_the_synthetic_actor(hostile_synthetic):
    address, proc, _ = hostile_synthetic
    # The attach waits up to 10 s for a peer that never comes; a stalled actor would answer the
    # generation only then. A margin of 5 s tells the two apart on a loaded machine.
    sock = closed_port_attach(address, timeout_s=10.0)
    time.sleep(0.3)  # the attach is under way (not a timing assert: the bound below is 5 s)
    gen, took = anyio.run(one_generation, address)
    assert gen.finish_reason in ("stop", "length") and took < 5.0
    got = replies(sock, 30.0, until=ReplyCause.ATTACH_FAILED)
    sock.close()
    assert any(isinstance(m, ErrorReply) and m.cause == ReplyCause.ATTACH_FAILED for m in got)
    assert proc.poll() is None


def test_a_keyless_process_can_reach_the_weight_store_but_not_join_or_poison_the_group(hostile_synthetic):
    """The weight group's TCPStore has no authentication: any local process can open it (here a
    plain TCPStore client, as if it had found the port by scanning). What it cannot know is the
    session (`weightsync.new_session`, sent only inside CURVE): it cannot join under a guess,
    junk it writes under the group's prefix and beside it changes nothing, and the next push is
    applied with the learner's exact weights."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from millstream.learner.sync.weights import WeightSender
    from millstream.shared.wire import DigestWeights, WeightsDigest
    from millstream.shared.wire.weightsync import flat_digest, make_group

    address, proc, _ = hostile_synthetic
    sender = WeightSender(
        address, LearnerConfig(sync_timeout_s=30), dtype="float32", keys=keys_for("learner")
    )
    weights = [(f"w{i}", torch.randn(1000 + i)) for i in range(4)]
    try:
        sender.attach()
        assert sender.group is not None
        session, port = sender.session, sender.group.store.port
        assert len(session) == len("learner-") + 32  # 128 random bits
        probe = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=5))
        for guess in ("learner", "learner-0", session[:20], "millstream"):
            # No member of a guessed group ever comes: half a second shows it as well as more.
            with pytest.raises(RuntimeError):
                make_group(probe, 1, sender.group.world, "gloo", 0.5, guess)
        for key in ("millstream/learner/0", f"millstream/{session[:20]}/learner", "rank_0", "0"):
            probe.set(key, b"junk")
        sender.push(weights, version=5)
        digest = sender.link.request(DigestWeights(), WeightsDigest, 30)
    finally:
        sender.close()
    learner = flat_digest(torch.cat([t for _, t in weights]))
    assert digest.version == 5 and digest.numel == learner[2]
    assert digest.total == pytest.approx(learner[0], rel=1e-9, abs=1e-9)
    assert proc.poll() is None


# --- the vLLM actor --------------------------------------------------------------------------------


def test_vllm_actor_survives_floods_and_a_closed_port_attach(actor):
    """The probe's actor findings against the real engine: floods of every kind, then an attach
    naming a closed port while a generation runs (it used to pause for the whole timeout)."""
    for kind in ("hello", "abort", "unexpected"):
        sock = dealer(actor.address)
        sock.send(Codec().encode([FLOODS[kind](i) for i in range(FLOOD)]))
        got = replies(sock, 2.0)
        sock.close()
        assert any(isinstance(m, ErrorReply) and m.cause == ReplyCause.TOO_MANY_MESSAGES for m in got)
    sock = dealer(actor.address)  # bad requests: each refused as it is read, none kills a task group
    sock.send(Codec().encode([GenerateRequest(f"r{i}", [], 4) for i in range(FLOOD)]))
    assert replies(sock, 3.0)
    sock.close()
    assert actor.proc.poll() is None
    _, plain = anyio.run(one_generation, actor.address)
    sock = closed_port_attach(actor.address, timeout_s=15.0)  # a stall would last 15 s
    time.sleep(0.3)  # the attach is under way
    gen, took = anyio.run(one_generation, actor.address)
    assert gen.finish_reason in ("stop", "length")
    assert took < plain + 7.0, (took, plain)
    got = replies(sock, 30.0, until=ReplyCause.ATTACH_FAILED)
    assert any(isinstance(m, ErrorReply) and m.cause == ReplyCause.ATTACH_FAILED for m in got)
    sock.close()
    assert actor.proc.poll() is None


# --- a real learner, fed by this test playing the envpool -------------------------------------------


def good_group(number: int, version: int) -> list[Trajectory]:
    return [
        traj(f"g{number}", f"g{number}-e{i}", versions=[-1, -1, version, version], reward=r, turn_rewards=[r])
        for i, r in enumerate((0.0, 1.0))
    ]


@pytest.mark.real
def test_learner_refuses_hostile_episodes_and_keeps_training(tiny_model_dir, hostile_synthetic, tmp_path):
    address, _, _ = hostile_synthetic
    exp, ver = free_port(), free_port()
    ready, log = tmp_path / "learner.json", tmp_path / "learner.log"
    cmd = [
        sys.executable, "-m", "millstream.learner", "--ready-file", str(ready),
        f"model.path={tiny_model_dir}", f"actor.connect={address}", f"run.dir={tmp_path / 'run'}",
        f"learner.experience_address=tcp://127.0.0.1:{exp}", f"learner.version_address=tcp://127.0.0.1:{ver}",
        "train.steps=2", "train.group_size=2", "train.groups_per_batch=1", "envpool.workers=1",
        "learner.max_buffer_groups=4", "learner.reward_range=[-10.0, 10.0]", "learner.idle_timeout_s=120",
        "envpool.admission_slack=20", KEYS,
    ]  # fmt: skip
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=out, start_new_session=True)
    try:
        wait_for_file(ready, proc, 300, "the learner", log=log)
        ctx = zmq.Context.instance()
        push, sub = ctx.socket(zmq.PUSH), ctx.socket(zmq.SUB)
        secure(push, keys_for("envpool", worker=0), bind=False)  # as worker 0
        secure(sub, keys_for("envpool", worker=0), bind=False)
        push.connect(f"tcp://127.0.0.1:{exp}")
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(f"tcp://127.0.0.1:{ver}")
        codec, sent = Codec(), 0

        def send(messages, announce: bool = True) -> None:
            """As a worker does: announce the groups it starts (GroupStarted), then the episodes.
            Forged ones are not announced: no worker started them."""
            nonlocal sent
            groups = sorted({m.group_id for m in messages if isinstance(m, (Trajectory, EpisodeFailed))})
            starts = [GroupStarted(0, "hostile-test", gid, 2) for gid in groups] if announce else []
            push.send(codec.encode([*starts, *messages]))
            sent += 2 * len(starts)

        def latest(wait_s: float = 2.0) -> PolicyVersion:
            seen = None
            deadline = time.monotonic() + wait_s
            while seen is None or sub.poll(0):
                if not sub.poll(max(1, int((deadline - time.monotonic()) * 1000))):
                    break
                seen = codec.decode(sub.recv())[0]
            assert isinstance(seen, PolicyVersion)
            return seen

        latest(5.0)
        push.send(codec.encode([WorkerHello(0, "hostile-test")]))  # as a worker greets a session
        first, greeted_by = latest(5.0), time.monotonic() + 30
        while first.admit_limit == 0 and time.monotonic() < greeted_by:
            first = latest()
        # g0 is started, and both its members report garbage: refused, each closing its slot.
        send([
            traj("g0", "g0-e0", reward=math.nan, turn_rewards=[math.nan]),
            traj("g0", "g0-e1", reward=1e308, turn_rewards=[1e308]),
        ])  # fmt: skip
        hostile = [
            traj("g1", "bad-size", group_size=3),  # g1 was admitted, but no worker started it
            traj(f"g{first.admit_limit + 5}", "forged-1", reward=1e9, turn_rewards=[1e9]),
            traj(f"g{first.admit_limit + 5}", "forged-2", reward=1e9, turn_rewards=[1e9]),
        ]
        send(hostile, announce=False)
        # The tools' key (no worker's) says hello as worker 0 and fails one of its episodes.
        forger = ctx.socket(zmq.PUSH)
        secure(forger, keys_for("envpool"), bind=False)
        forger.connect(f"tcp://127.0.0.1:{exp}")
        forger.send(codec.encode([
            WorkerHello(0, "forged"),
            GroupStarted(0, "forged", "g1", 2),
            EpisodeFailed("g1-e0", "g1", 2, Cause.ENV_ERROR, "forged"),
        ]))  # fmt: skip
        # More complete groups than the buffer holds (4): the excess is refused, not a crash.
        send([t for n in range(2, 8) for t in good_group(n, first.version)])
        deadline, number = time.monotonic() + 240, 8
        while (v := latest()).version < 2 and not v.final and time.monotonic() < deadline:
            send(good_group(number, v.version))
            number += 1
        while not latest().final and time.monotonic() < deadline:
            pass
        send([PoolDone("w0", sent, sent, 0)])
        assert proc.wait(timeout=120) == 0, log.read_text()[-3000:]
    finally:
        stop(proc, grace_s=0)
    summary = orjson.loads((tmp_path / "run" / "summary.json").read_bytes())
    assert summary["accounting_ok"] is True and summary["version"] == 2
    assert summary["episodes_foreign"] == 4  # the hostile ones: received, refused, not the run's
    refused = summary["episodes_refused"]
    assert refused["reward_not_finite"] == 1 and refused["reward_out_of_range"] == 1  # g0's slots
    assert refused["unstarted_group"] == 1 and refused["unannounced_group"] == 2
    assert refused["not_a_worker"] == 1 and summary["messages_refused"]["wrong_worker"] == 2
    assert summary["worker_restarts"] == summary["worker_lost"] == 0  # the forged hello did nothing
    assert refused.get("buffer_full", 0) > 0
    assert summary["episodes_dropped"]["invalid_trajectory"] == sum(refused.values())
    assert log.stat().st_size < 200_000
    # The run's own episodes are in its store; none of the refused ones is.
    recorded = read_episodes(tmp_path / "run")
    assert recorded and all(r["fate"] in ("trained", "dropped", "failed") for r in recorded)
    assert len(recorded) <= summary["episodes_started"]


def _two_worker_intake():
    from millstream.learner.episodes.intake import Intake
    from millstream.learner.episodes.workers import WorkerLedger
    from millstream.shared.config import load_config

    cfg = load_config(None, ["train.group_size=2", "envpool.workers=2"])
    buf = ReplayBuffer(group_size=2, groups_per_batch=4, max_staleness=2, max_groups=8)
    ledger = WorkerLedger(2, group_base=0, group_size=2)
    intake = Intake(cfg, buf, ledger, EpisodeCheck(LearnerConfig(), vocab=256), lambda *record: None)

    def handle(message, sender):
        intake.handle(message, sender, version=0, admitted=10)

    return buf, ledger, intake, handle


def test_a_reply_stream_with_a_lost_delta_fails_its_turn_instead_of_ending_short():
    """Each delta says where its first token sits in the output (`TokenDelta.offset`): a stream
    whose middle delta never arrived (a queue full for a minute drops a reply) fails its turn as
    `actor_gap`, which is retried, rather than ending well with its tokens short and being
    trained on as if whole. A scripted actor plays the stream; the client is the envpool's."""
    from millstream.envpool.actors.client import GenerationFailed
    from millstream.shared.config import TransportConfig
    from millstream.shared.wire import TokenDelta
    from millstream.shared.wire.causes import RETRYABLE_CAUSES
    from millstream.shared.wire.transport import open_channel

    cfg = TransportConfig()
    router = open_channel("router", "tcp://127.0.0.1:0", bind=True, cfg=cfg, keys=keys_for("actor"))

    async def scripted_actor() -> None:
        served = 0
        async for peer, messages in router:
            for m in messages:
                if not isinstance(m, GenerateRequest):
                    continue
                served += 1
                whole = served == 1  # the first stream whole, the second without its middle
                await router.send(TokenDelta(m.request_id, [5], [-0.1], 0, offset=0), to=peer)
                if whole:  # the delta the other stream loses
                    await router.send(TokenDelta(m.request_id, [6, 7], [-0.2, -0.3], 0, offset=1), to=peer)
                await router.send(TokenDelta(m.request_id, [8], [-0.4], 0, "length", offset=3), to=peer)

    async def body(client, tg):
        tg.start_soon(router.run)
        tg.start_soon(scripted_actor)
        sampling = Sampling(max_tokens=4, timeout_s=10)
        whole = await client.generate_once([1, 2], sampling, seed=None)
        with pytest.raises(GenerationFailed) as failed:
            await client.generate_once([1, 2], sampling, seed=None)
        return whole, failed.value

    whole, failed = anyio.run(with_client, router.address, body, backend="trio")
    assert whole.token_ids == [5, 6, 7, 8] and whole.finish_reason == "length"
    assert failed.cause == Cause.ACTOR_GAP and "one was lost" in str(failed)
    assert failed.cause in RETRYABLE_CAUSES  # a lost delta is the link's loss, not the episode's


def test_a_flood_of_experience_does_not_hold_the_learner_s_loop():
    """`Experience.receive` took every queued frame before it returned: workers that send as
    fast as the learner reads held its loop there, away from its version heartbeat and its
    steps. It now returns at most `DRAIN_S` past its deadline, with the senders still going."""
    import threading

    from millstream.learner.episodes.experience import Experience
    from millstream.shared.config import load_config

    exp_port, ver_port = free_port(), free_port()
    cfg = load_config(None, [
        KEYS, f"learner.experience_address=tcp://127.0.0.1:{exp_port}",
        f"learner.version_address=tcp://127.0.0.1:{ver_port}",
    ])  # fmt: skip
    exp = Experience(cfg, keys_for("learner"))
    frame = Codec().encode([PoolDone("envpool", 0, 0, 0)] * 20)  # 20 messages to decode per frame
    stop_sending = threading.Event()

    def flood() -> None:
        push: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PUSH)
        secure(push, keys_for("envpool"), bind=False)
        push.connect(f"tcp://127.0.0.1:{exp_port}")
        deadline = time.monotonic() + 30  # a bound for the old code, which returns only after it
        try:
            while not stop_sending.is_set() and time.monotonic() < deadline:
                push.send(frame)
        finally:
            push.close(0)

    sender = threading.Thread(target=flood, daemon=True)
    try:
        sender.start()
        first = next(exp.receive(5.0))  # the flood has begun
        started = time.monotonic()
        taken = sum(1 for _ in exp.receive(0.05))
        returned_s = time.monotonic() - started
        still_flooding = sender.is_alive()
    finally:
        stop_sending.set()
        sender.join(35)
        exp.close()
    assert isinstance(first[0], PoolDone) and taken > 0
    assert still_flooding, f"receive returned only when the flood ended ({returned_s:.1f}s, {taken} messages)"


def test_a_worker_s_key_speaks_for_that_worker_only():
    """issue 27: one envpool key spoke for every worker. A forged WorkerHello(index=0, new
    incarnation) wrote off worker 0's 16 live episodes as worker_lost; forged failures for the
    members of new groups became 142 fake env_errors. With a key per worker, and group numbers
    that say whose a group is (worker i numbers i, i + workers, ...), the learner takes worker
    i's hello, groups and episodes from worker i's key only."""
    buf, ledger, intake, handle = _two_worker_intake()
    handle(WorkerHello(0, "w0-a"), "envpool-0")
    handle(WorkerHello(1, "w1-a"), "envpool-1")
    handle(GroupStarted(0, "w0-a", "g0", 2), "envpool-0")
    handle(GroupStarted(1, "w1-a", "g1", 2), "envpool-1")
    # Worker 1's key (or the tools' shared key) forging for worker 0:
    handle(WorkerHello(0, "forged"), "envpool-1")  # would close g0 as worker_lost
    handle(GroupStarted(0, "w0-a", "g2", 2), "envpool-1")  # would take g2 for worker 0
    handle(GroupStarted(1, "w1-a", "g0", 2), "envpool-1")  # would take worker 0's g0 over
    handle(GroupStarted(1, "w1-a", "g4", 2), "envpool-1")  # g4 is worker 0's number
    handle(
        WorkerHello(1, "w1-a", live=["g0-e0", "g0-e1", "g1-e0", "g1-e1"]), "envpool-1"
    )  # reopen g0 as its own
    handle(EpisodeFailed("g0-e0", "g0", 2, Cause.ENV_ERROR, "forged"), "envpool-1")
    handle(EpisodeFailed("g2-e0", "g2", 2, Cause.ENV_ERROR, "forged"), "envpool-1")  # worker 0's, not started
    handle(EpisodeFailed("g5-e0", "g5", 2, Cause.ENV_ERROR, "forged"), "envpool-1")  # its own, never started
    handle(traj("g0", "g0-e1", reward=1.0), "envpool")  # the tools' key: no worker
    handle(PoolDone("w0", 2, 2, 0), "envpool-1")
    assert ledger.incarnations == {0: "w0-a", 1: "w1-a"} and ledger.lost == 0
    assert set(ledger.open) == {"g0", "g1"} and ledger.owner("g0") == 0
    assert ledger.open["g0"].pending == {"g0-e0", "g0-e1"} and ledger.started_total == 4
    assert intake.done_workers == {}
    counts = intake.refusals.counts
    assert counts == {"wrong_worker": 5, "bad_group_started": 2, "unstarted_group": 1, "not_a_worker": 1}
    assert buf.refused == {"wrong_worker": 2, "unstarted_group": 1, "not_a_worker": 1}
    assert intake.foreign == 4 and buf.failed == {}
    # The real reports are taken, every slot is the real worker's.
    for gid, worker in (("g0", 0), ("g1", 1)):
        for m in range(2):
            handle(traj(gid, f"{gid}-e{m}", reward=float(m)), f"envpool-{worker}")
    assert ledger.open == {} and buf.statistics()["complete_groups"] == 2
    assert buf.statistics()["received"] - intake.foreign == ledger.started_total == 4
    handle(traj("g0", "g0-e0", reward=0.5), "envpool-1")  # a re-send under another key: refused
    assert buf.duplicates == 0 and buf.refused["wrong_worker"] == 3
    handle(PoolDone("w1", 2, 2, 0), "envpool-1")
    assert set(intake.done_workers) == {"w1"}
    accounted(buf)


def test_a_restarted_learner_takes_a_worker_s_backlog_before_its_hello():
    """After a learner restart, a worker's results from before its hello name groups the
    restored ledger never saw; they are its own while its numbers say so, whether or not they
    fit the bounded hold. Another worker's key cannot claim them."""
    buf, ledger, intake, handle = _two_worker_intake()
    handle(traj("g2", "g2-e0", reward=0.0), "envpool-0")  # worker 0's number: its backlog
    handle(traj("g2", "g2-e1", reward=1.0), "envpool-0")
    handle(EpisodeFailed("g4-e0", "g4", 2, Cause.ENV_ERROR, "forged"), "envpool-1")  # worker 0's number
    assert buf.statistics()["complete_groups"] == 1 and buf.refused == {"wrong_worker": 1}
    assert intake.foreign == 1  # the backlog is the run's, the forgery is not
    handle(WorkerHello(0, "w0-b", started=2, reported=2), "envpool-0")
    assert ledger.greeted == {0}
    handle(traj("g6", "g6-e0", reward=1.0), "envpool-0")  # after its hello: must be started first
    assert buf.refused == {"wrong_worker": 1, "unstarted_group": 1} and intake.foreign == 2


def test_the_experience_socket_names_each_message_s_sender():
    """The intake's checks rest on this: each message comes with the key it was sent with."""
    from millstream.learner.episodes.experience import Experience
    from millstream.shared.config import load_config

    exp_port, ver_port = free_port(), free_port()
    cfg = load_config(None, [
        KEYS, "envpool.workers=2", f"learner.experience_address=tcp://127.0.0.1:{exp_port}",
        f"learner.version_address=tcp://127.0.0.1:{ver_port}",
    ])  # fmt: skip
    exp = Experience(cfg, keys_for("learner"))
    ctx, codec = zmq.Context.instance(), Codec()
    pushes = []
    try:
        for keys in (keys_for("envpool", worker=1), keys_for("envpool"), keys_for("actor")):
            push = ctx.socket(zmq.PUSH)
            secure(push, keys, bind=False)
            push.connect(f"tcp://127.0.0.1:{exp_port}")
            push.send(codec.encode([PoolDone(keys.role, 0, 0, 0)]))
            pushes.append(push)
        got: list = []
        deadline = time.monotonic() + 10
        while len(got) < 3 and time.monotonic() < deadline:
            got += exp.receive(0.2)
        assert sorted((m.worker, sender) for m, sender in got) == [
            ("actor", "actor"), ("envpool", "envpool"), ("envpool-1", "envpool-1")
        ]  # fmt: skip
    finally:
        for push in pushes:
            push.close(0)
        exp.close()
