"""A weight push's pieces (learner/sync/weights.py `FlatWeights`) and the receiving side's kept
buffer (actor/receive.py `WeightReceiver`), over a real gloo group of two in this process."""

from __future__ import annotations

import fcntl
import json
import os
import socket
import struct
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from millstream.actor.receive import WeightReceiver
from millstream.learner.sync.layout import DIRECT_MIN_BYTES, FlatWeights, LayoutChanged
from millstream.shared.process.runtime import free_port
from millstream.shared.wire.weightsync import (
    flat_digest,
    gpu_identity,
    make_group,
    open_store,
    pick_backend,
    piece_ranges,
    start_broadcast,
    wait_all,
)

BIG = DIRECT_MIN_BYTES // 4  # float32 elements of a tensor sent from where it lies


def model(scale: float = 1.0) -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    shapes = {"embed": (BIG,), "norm1": (7,), "bias1": (5, 3), "proj": (2, BIG), "norm2": (11,)}
    return [(name, scale * torch.randn(shape, generator=gen)) for name, shape in shapes.items()]


def test_large_tensors_are_sent_from_where_they_lie_and_small_ones_packed():
    weights = model()
    flat = FlatWeights("float32", "gloo", bucket_mb=32)
    flat.lay_out(weights)
    sizes = [t.numel() for _, t in weights]
    # embed alone, norm1 + bias1 packed, proj alone, norm2 packed
    assert flat.piece_ends == [BIG, BIG + 22, BIG + 22 + 2 * BIG, sum(sizes)]
    pieces = list(flat.sources(weights))
    assert pieces[0].data_ptr() == weights[0][1].data_ptr()  # no copy
    assert pieces[2].data_ptr() == weights[3][1].data_ptr()
    assert torch.equal(pieces[1], torch.cat([weights[1][1].reshape(-1), weights[2][1].reshape(-1)]))
    assert torch.equal(torch.cat(pieces), torch.cat([t.reshape(-1) for _, t in weights]))
    # Only norm1 + bias1 are packed: norm2, a piece alone, goes as it is.
    assert flat._staging is not None and flat._staging.numel() == 22
    assert pieces[3].data_ptr() == weights[4][1].data_ptr()
    assert flat.digest() is None  # no push completed
    flat.sent_version = 1
    expected = flat_digest(torch.cat([t.reshape(-1) for _, t in weights]))
    assert flat.digest() == pytest.approx(expected, rel=1e-12)


def test_small_tensors_are_packed_into_pieces_of_about_the_bucket_size():
    weights = [(f"w{i}", torch.full((1000,), float(i))) for i in range(100)]
    flat = FlatWeights("float32", "gloo", bucket_mb=8000 * 4 / 2**20)  # 8,000 elements
    flat.lay_out(weights)
    ranges = piece_ranges(100_000, flat.piece_ends)
    assert [end - start for start, end in ranges] == [8000] * 12 + [4000]
    assert torch.equal(torch.cat(list(flat.sources(weights))), torch.cat([t for _, t in weights]))


def test_a_tensor_of_another_dtype_is_cast_into_the_buffer():
    weights = [("embed", torch.randn(2 * BIG, dtype=torch.float32))]
    flat = FlatWeights("bfloat16", "gloo")
    flat.lay_out(weights)
    (piece,) = flat.sources(weights)
    assert piece.dtype == torch.bfloat16 and torch.equal(piece, weights[0][1].to(torch.bfloat16))


def test_a_push_of_other_shapes_is_refused():
    flat = FlatWeights("float32", "gloo")
    flat.lay_out(model())
    with pytest.raises(LayoutChanged, match="changed between pushes"):
        flat.lay_out(model()[:-1])


def test_the_backend_is_nccl_only_where_every_member_has_a_gpu_of_its_own():
    """NCCL refuses two ranks on one GPU ("Duplicate GPU detected"): a one-GPU run, where the
    learner and the actor share it, syncs over gloo; an explicit 'nccl' that cannot work is
    refused with the reason, before a group is attempted."""
    learner, other, third = "GPU-aaaa", "GPU-bbbb", "GPU-cccc"
    assert pick_backend("auto", [learner, other, third]) == "nccl"
    assert pick_backend("auto", [learner, learner]) == "gloo"  # the actor on the learner's GPU
    assert pick_backend("auto", [learner, other, other]) == "gloo"  # two replicas on one GPU
    assert pick_backend("auto", [learner, ""]) == "gloo"  # a replica on the CPU
    assert pick_backend("auto", ["", ""]) == "gloo"
    assert pick_backend("gloo", [learner, other]) == "gloo"
    assert pick_backend("nccl", [learner, other]) == "nccl"
    with pytest.raises(ValueError, match="two members of the weight group compute on GPU GPU-bbbb"):
        pick_backend("nccl", [learner, other, other])
    with pytest.raises(ValueError, match="1 of the weight group's 2 members compute on the CPU"):
        pick_backend("nccl", [learner, ""])
    with pytest.raises(ValueError, match="must be auto, gloo or nccl"):
        pick_backend("mpi", [learner])
    # Members not known yet (before any replica answered): CUDA decides, as before.
    assert pick_backend("auto") == ("nccl" if torch.cuda.is_available() else "gloo")
    assert gpu_identity("cpu") == gpu_identity(None) == ""


def test_an_nccl_group_that_cannot_form_stops_the_start_but_only_refuses_a_later_joiner():
    """At the run's start a config that cannot work stops the learner, saying why; a replica
    that joins later on a GPU already in use is refused (backed off), the run goes on."""
    from millstream.learner.sync.weights import WeightSyncError, group_backend
    from millstream.shared.config import ConfigError
    from millstream.shared.wire import ActorInfo

    on_cpu = [ActorInfo("m", 0, 1, 64, "float32")]  # this learner is on the CPU too
    with pytest.raises(ConfigError, match="compute on the CPU"):
        group_backend("nccl", on_cpu)
    with pytest.raises(WeightSyncError, match="compute on the CPU"):
        group_backend("nccl", on_cpu, strict=False)
    assert group_backend("auto", on_cpu) == "gloo"


@pytest.mark.parametrize("ends", [[5, 3, 10], [5, 9], [0, 10]])
def test_pieces_that_do_not_cover_the_buffer_in_order_are_refused(ends):
    with pytest.raises(ValueError, match="do not cover 10 elements"):
        piece_ranges(10, ends)


def gloo_pair(timeout_s: float = 20.0):
    """The two members of a gloo group, formed in this process (rank 0, rank 1)."""
    store = open_store("127.0.0.1", 0, 2, is_master=True, timeout_s=timeout_s)

    def member(rank: int):
        own = (
            store
            if rank == 0
            else open_store("127.0.0.1", store.port, 2, is_master=False, timeout_s=timeout_s)
        )
        return make_group(own, rank, 2, "gloo", timeout_s, "test"), own

    with ThreadPoolExecutor(2) as pool:
        (sender, _), (receiver, kept) = pool.map(member, [0, 1])
    return sender, receiver, (store, kept)


def push(group, flat: FlatWeights, weights) -> None:
    flat.lay_out(weights)
    wait_all([start_broadcast(group, piece, 20) for piece in flat.sources(weights)], 20)
    flat.sent_version = 1


def test_the_receiver_keeps_one_buffer_and_sums_it_only_when_asked():
    sender, receiver_group, _stores = gloo_pair()
    flat, receiver = FlatWeights("float32", "gloo"), WeightReceiver()
    assert receiver.digest() == (0.0, 0.0, 0)  # before any update
    buffers = []
    for scale in (1.0, 2.0):
        weights = model(scale)
        flat.lay_out(weights)
        numel = sum(t.numel() for _, t in weights)
        receiver.start(receiver_group, "float32", numel, flat.piece_ends, "cpu", 20)
        push(sender, flat, weights)
        buffers.append(receiver.wait(20))
        assert torch.equal(buffers[-1], torch.cat([t.reshape(-1) for _, t in weights]))
        with pytest.raises(RuntimeError, match="not loaded"):
            receiver.digest()  # received, not yet loaded: not what the engine holds
        receiver.loaded()
        assert receiver.digest() == pytest.approx(flat.digest(), rel=1e-12)
    assert buffers[0].data_ptr() == buffers[1].data_ptr()  # the same memory, not a fresh buffer
    assert receiver.shares_memory_with([buffers[1][10:20]])
    assert not receiver.shares_memory_with([buffers[1].clone()])


def test_a_receive_that_never_completes_is_an_error_and_leaves_no_digest():
    _sender, receiver_group, _stores = gloo_pair()
    receiver = WeightReceiver()
    receiver.start(receiver_group, "float32", 100, [], "cpu", timeout_s=1.0)  # nobody sends
    with pytest.raises(RuntimeError, match="weight broadcast failed"):
        receiver.wait(10)
    with pytest.raises(RuntimeError, match="weight broadcast failed"):
        receiver.done()
    with pytest.raises(RuntimeError, match="not loaded"):
        receiver.digest()


def test_a_receive_left_running_is_abandoned_by_the_next_one():
    """An update the actor gave up on must not block the next one (a re-attached learner's):
    the new receive gets a fresh buffer and completes; the old thread writes only its own."""
    sender, receiver_group, _stores = gloo_pair()
    # A group nobody will send on. Its sender side is kept alive: collected, it closes its end,
    # the stale receive fails at once, and a receive that ended may lend the next one its buffer.
    stale = gloo_pair()
    stale_group = stale[1]
    flat, receiver = FlatWeights("float32", "gloo"), WeightReceiver()
    weights = model()
    flat.lay_out(weights)
    numel = sum(t.numel() for _, t in weights)
    receiver.start(stale_group, "float32", numel, flat.piece_ends, "cpu", timeout_s=30)
    abandoned = receiver._receive
    receiver.start(receiver_group, "float32", numel, flat.piece_ends, "cpu", 20)
    push(sender, flat, weights)
    fresh = receiver.wait(20)
    assert torch.equal(fresh, torch.cat([t.reshape(-1) for _, t in weights]))
    assert abandoned is not None and abandoned.buffer.data_ptr() != fresh.data_ptr()


def test_a_buffer_the_engine_kept_is_released_with_its_digest():
    sender, receiver_group, _stores = gloo_pair()
    flat, receiver = FlatWeights("float32", "gloo"), WeightReceiver()
    weights = model()
    flat.lay_out(weights)
    receiver.start(receiver_group, "float32", sum(t.numel() for _, t in weights), flat.piece_ends, "cpu", 20)
    push(sender, flat, weights)
    kept = receiver.wait(20)
    receiver.loaded()
    receiver.release()  # as the worker does when the engine's weights are views of it
    assert receiver.digest() == pytest.approx(flat.digest(), rel=1e-12)
    assert not receiver.shares_memory_with([kept])  # the next update receives elsewhere


#: Appended to a script: `out`, the IPv4 addresses this process listens on (TCP).
OWN_LISTENERS = """
inodes = set()
for fd in os.listdir("/proc/self/fd"):
    try:
        link = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:  # the listing's own descriptor, closed by now
        continue
    if link.startswith("socket:["):
        inodes.add(link[8:-1])
out = []
for line in open("/proc/net/tcp").read().splitlines()[1:]:
    f = line.split()
    if f[3] == "0A" and f[9] in inodes:  # listening, and this process's
        ip = f[1].split(":")[0]
        out.append(".".join(str(int(ip[i : i + 2], 16)) for i in (6, 4, 2, 0)))
"""

LISTENERS = """
import json, os, sys
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
import torch.distributed as dist
from millstream.shared.wire.weightsync import make_group, open_store
store = open_store("127.0.0.1", 0, 2, is_master=True, timeout_s=20)
def member(rank):
    own = store if rank == 0 else open_store("127.0.0.1", store.port, 2, is_master=False, timeout_s=20)
    if sys.argv[1] == "gloo-default":
        return dist.ProcessGroupGloo(dist.PrefixStore("p", own), rank, 2, timedelta(seconds=20))
    return make_group(own, rank, 2, "gloo", 20, "s")
with ThreadPoolExecutor(2) as pool:
    groups = list(pool.map(member, [0, 1]))
"""
LISTENERS += OWN_LISTENERS + "print(json.dumps(out))\n"


def listening_addresses(kind: str, interface: str) -> list[str]:
    env = {**os.environ, "GLOO_SOCKET_IFNAME": interface}
    proc = subprocess.run(
        [sys.executable, "-c", LISTENERS, kind], env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def ipv4_of(interface: str) -> str | None:
    """The interface's IPv4 address, or None (SIOCGIFADDR)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            packed = fcntl.ioctl(sock.fileno(), 0x8915, struct.pack("256s", interface.encode()[:15]))
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])


def test_the_weight_group_listens_on_loopback_when_its_store_does():
    """gloo listens where the host's name resolves (or on GLOO_SOCKET_IFNAME): on a machine whose
    name resolves to a LAN address a loopback run would listen there, unauthenticated. The
    group's members listen on loopback when its store does (`weightsync.on_loopback`)."""
    others = [name for _, name in socket.if_nameindex() if name != "lo" and ipv4_of(name)]
    interface = others[0] if others else "lo"
    ours = listening_addresses("millstream", interface)
    assert len(ours) == 3 and set(ours) == {"127.0.0.1"}, ours  # the store and two members
    if others:  # the control: gloo's own default, same environment, listens on the interface
        default = listening_addresses("gloo-default", interface)
        assert any(address != "127.0.0.1" for address in default), default


RANK = """
import json, os, sys
rank, port, interface = sys.argv[1], sys.argv[2], sys.argv[3]
os.environ.update(
    RANK=rank, LOCAL_RANK=rank, WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
    GLOO_SOCKET_IFNAME=interface,
)
from millstream.learner.train.dssetup import import_deepspeed, init_distributed
ours = init_distributed(import_deepspeed(), timeout_s=1234)
import torch, torch.distributed as dist
group = dist.distributed_c10d._get_default_group()
timeout_s = group._get_backend(torch.device("cpu")).options._timeout.total_seconds()
"""
# Rank 0 beats while it waits (learner/team.py): nothing before BEAT_S, "wait" after; rank 1
# sees exactly that, then follows it with the learner's own loop until "stop".
RANK += """
import time
from millstream.learner import team as teams
from millstream.learner.follower import follow
from millstream.shared.config import load_config
team = teams.Team()
seen = []
if team.leader:
    for _ in range(2):
        team.beat()  # said nothing for less than BEAT_S: says nothing
        team.said -= teams.BEAT_S + 1
        team.beat()  # "wait"
        team.command("stop")
else:
    while not seen or seen[-1] != "stop":
        seen.append(team.next_command()[0])
    follow(load_config(None, []), None, team)  # "wait" is passed over, "stop" ends it
"""
RANK += OWN_LISTENERS
RANK += 'print(json.dumps({"listening": out, "ours": ours, "timeout_s": timeout_s, "seen": seen}))\n'


@pytest.mark.real
def test_a_data_parallel_learners_group_listens_on_loopback_when_it_meets_there():
    """The learner's own group (learner.ranks > 1, DeepSpeed's gloo groups): gloo listens on
    GLOO_SOCKET_IFNAME or where the host's name resolves, and a default group takes no options,
    so a loopback learner pins the interface to loopback while its groups form and hands the
    variable back as it was (here set to a LAN interface, as a LAN-resolving hostname would).
    The group's collectives are bounded by the timeout it is given, not torch's default, and
    rank 0 beats while it waits, so that a follower never sits in one collective for long."""
    others = [name for _, name in socket.if_nameindex() if name != "lo" and ipv4_of(name)]
    interface = others[0] if others else "lo"
    port = str(free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RANK, str(rank), port, interface], stdout=subprocess.PIPE, text=True
        )
        for rank in (0, 1)
    ]
    outs = [json.loads(p.communicate(timeout=240)[0].strip().splitlines()[-1]) for p in procs]
    assert all(p.returncode == 0 for p in procs)
    for out in outs:
        assert out["listening"] and set(out["listening"]) == {"127.0.0.1"}, out
        assert out["ours"] == {"GLOO_SOCKET_IFNAME": interface}  # put back by the trainer
        assert out["timeout_s"] == 1234  # the learner's bound (learner/team.py), not torch's default
    assert outs[1]["seen"] == ["wait", "stop"]  # rank 0's beat, and only once BEAT_S had passed
