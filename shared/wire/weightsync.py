"""How learner and actor form the weight-broadcast group, shared so they cannot disagree.

The group is *stateless*: a `ProcessGroupGloo` (CPU) or `ProcessGroupNCCL` (GPU) built directly
on its own `TCPStore`, never registered in torch.distributed's default world. vLLM owns the
default group of its workers and DeepSpeed owns the learner's; this third world has exactly
`1 + weight_ranks` members (learner rank 0, then each vLLM worker) and is rebuilt from scratch
whenever a new learner session attaches, so a restarted learner never inherits a broken group.

The learner hosts the store on a free port (`open_store(port=0)`), tells the actor the port in
`AttachLearner`, and both call `make_group`. Every collective is bounded by a timeout: a peer that
died shows up as an error within `timeout_s`, not a 30-minute NCCL hang.

Weights travel as one flat buffer per update (`flat_layout` gives each tensor's offset), sent as
consecutive pieces, each one collective: a large tensor is a piece of its own, broadcast straight
from the learner's parameter (no copy, where its dtype and device are the wire's), and runs of
small ones are packed and sent as a few large pieces (one large collective beats many small
ones). The receivers take every piece into its slice of their own flat buffer
(`broadcast_pieces`); the piece ends and the layout go in the `WeightUpdate` message.
"""

from __future__ import annotations

import hashlib
import ipaddress
import secrets
import socket
import time
from collections.abc import Iterable, Sequence
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

__all__ = [
    "DTYPES",
    "session_tag",
    "open_store",
    "listen_on",
    "make_group",
    "start_broadcast",
    "broadcast_pieces",
    "piece_ranges",
    "flat_layout",
    "pick_backend",
    "gpu_identity",
    "on_loopback",
    "mark_session",
    "new_session",
    "await_session",
    "flat_digest",
    "wait_all",
]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def pick_backend(name: str, gpus: Sequence[str] = ()) -> str:
    """The weight group's backend for `learner.sync_backend = name`.

    `gpus` holds the GPU of every member of the group, the learner first (`gpu_identity`: ""
    for one on the CPU); left out, the members are not known yet. 'auto' is NCCL when every
    member computes on a GPU of its own, gloo otherwise. NCCL refuses two ranks on one GPU
    ("Duplicate GPU detected"), and a run on one GPU puts the learner and its actor there, as
    can a machine with too few GPUs for every process (shared/process/gpus.py); gloo then
    carries the weights through host memory. An explicit 'nccl' that cannot work is a
    ValueError naming why, before any group is attempted.
    """
    if name not in ("auto", "gloo", "nccl"):
        raise ValueError(f"learner.sync_backend must be auto, gloo or nccl, got {name!r}")
    if name == "gloo":
        return name
    if not gpus:
        return "nccl" if name == "nccl" or torch.cuda.is_available() else "gloo"
    shared = next((gpu for i, gpu in enumerate(gpus) if gpu and gpu in gpus[:i]), None)
    on_cpu = sum(1 for gpu in gpus if not gpu)
    if name == "auto":
        return "nccl" if shared is None and not on_cpu else "gloo"
    if shared is not None:
        raise ValueError(
            f"learner.sync_backend = 'nccl', but two members of the weight group compute on GPU "
            f"{shared}: NCCL cannot connect two processes on one GPU; use 'auto' (gloo, then) or "
            "'gloo', or give each role GPUs of its own (actor.gpus, learner.gpus)"
        )
    if on_cpu:
        raise ValueError(
            f"learner.sync_backend = 'nccl', but {on_cpu} of the weight group's {len(gpus)} members "
            "compute on the CPU; use 'auto' or 'gloo'"
        )
    return name


def gpu_identity(device: torch.device | str | None) -> str:
    """Which GPU `device` is, as NCCL tells GPUs apart: by host (its name and boot, as NCCL's
    host hash) and PCI address, so that MIG instances of one card count as one GPU; "" for
    anything but a CUDA device. An index would not do: it depends on each process's
    CUDA_VISIBLE_DEVICES."""
    if device is None or torch.device(device).type != "cuda" or not torch.cuda.is_available():
        return ""
    props = torch.cuda.get_device_properties(torch.device(device))
    domain, bus, slot = (getattr(props, f"pci_{part}_id", None) for part in ("domain", "bus", "device"))
    if domain is None or bus is None or slot is None:  # an older torch: the UUID (MIG: its own)
        return str(props.uuid)
    return f"{host_identity()}/{domain:04x}:{bus:02x}:{slot:02x}"


def host_identity() -> str:
    """This machine, as NCCL's host hash sees it: its name and the kernel's boot id (two
    containers of one host share the boot id; two hosts of one name do not)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}:{boot}"


def open_store(host: str, port: int, world_size: int, *, is_master: bool, timeout_s: float):
    """The group's TCPStore; the master may pass port 0 and read the chosen one from `.port`.

    The master listens on `host` only: torch's TCPStore binds every interface when it opens its
    own socket, whatever host it is given, so we bind the socket and hand it over.

    A client first waits for the port to accept a connection (`wait_for_listener`), then opens
    the store in what is left of `timeout_s`. torch's own client retries a failed connect after
    a random back-off of up to its timeout and then tries again for a whole timeout: an attach
    naming a closed port with a 15 s timeout took 46 s here, and the sender had long given up.
    """
    started = time.monotonic()
    listen_fd = listen_on(host, port) if is_master else None
    if not is_master:
        wait_for_listener(host, port, timeout_s)
    left = max(1.0, timeout_s - (time.monotonic() - started))
    return dist.TCPStore(
        host,
        port,
        world_size,
        is_master=is_master,
        timeout=timedelta(seconds=left),
        wait_for_workers=False,
        master_listen_fd=listen_fd,
    )


def wait_for_listener(host: str, port: int, timeout_s: float) -> None:
    """Return once `host:port` accepts a TCP connection; TimeoutError after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"nothing accepted a connection at {host}:{port} within {timeout_s:.0f}s")
        try:
            socket.create_connection((host, port), timeout=min(1.0, left)).close()
            return
        except OSError:  # refused (nothing listens yet) or timed out: try again shortly
            time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))


def listen_on(host: str, port: int) -> int:
    """A listening TCP socket on `host:port` (0: a free port), as a file descriptor the caller
    owns (a TCPStore takes it over)."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(address)
    sock.listen(512)
    return sock.detach()


def new_session() -> str:
    """A fresh learner session: the name of a weight group in its store.

    The store is a TCPStore on a port any local process can reach, with no authentication of its
    own; every key of the group is under `millstream/<session>/`, and TCPStore has no call that
    lists keys. So the session is the secret that keeps a keyless process from joining the group
    or writing its keys: 128 random bits, sent to the replicas only inside the CURVE-encrypted
    `AttachLearner` (tests/test_hostile.py probes it)."""
    return f"learner-{secrets.token_hex(16)}"


def session_tag(session: str) -> str:
    """What logs and error replies show of a session: a short digest. The session itself is a
    secret (see `new_session`), and logs are read by more people and tools than the run."""
    return "session#" + hashlib.sha256(session.encode()).hexdigest()[:10]


def _session_key(session: str) -> str:
    return f"millstream/{session}/learner"


def mark_session(store, session: str) -> None:
    """The learner says, in its store, that it is forming `session`'s group (see await_session)."""
    store.set(_session_key(session), b"1")


def await_session(host: str, port: int, session: str, timeout_s: float) -> None:
    """Return once the store at host:port is up and its learner marked `session`; raise otherwise.

    The actor calls this in a thread of its own process before it asks its engine to join. Joining
    blocks the engine (vLLM's workers run the join inside their busy loop, so generation stops),
    and an `AttachLearner` naming a closed port or a store of no learner would stall it for the
    sender's whole timeout. Checked here first, a bad attach costs one idle thread, not the
    engine.
    """
    store = open_store(host, port, 1, is_master=False, timeout_s=timeout_s)
    store.wait([_session_key(session)], timedelta(seconds=timeout_s))


def make_group(store, rank: int, world_size: int, backend: str, timeout_s: float, session: str):
    """Join the group (blocks until all `world_size` members joined, at most `timeout_s`)."""
    timeout = timedelta(seconds=timeout_s)
    prefixed = dist.PrefixStore(f"millstream/{session}", store)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, world_size, opts)
    if backend == "gloo":
        if not on_loopback(getattr(store, "host", "")):  # gloo's own choice (GLOO_SOCKET_IFNAME)
            return dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
        options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # not in the stubs
        options._timeout = timeout
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=store.host)]
        return dist.ProcessGroupGloo(prefixed, rank, world_size, options)
    raise ValueError(f"weight sync backend must be 'gloo' or 'nccl', got {backend!r}")


def start_broadcast(group, tensor: torch.Tensor, timeout_s: float):
    """Start broadcasting `tensor` from rank 0 of `group`; returns the work to `finish`.

    Several may be in flight on one group: each member starts the same collectives in the same
    order, and gloo and NCCL match them by that order (gloo by a tag it takes in turn), so the
    learner starts piece k and packs piece k+1 while the receivers have started them all."""
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    opts.rootTensor = 0
    opts.timeout = timedelta(seconds=timeout_s)
    return group.broadcast([tensor], opts)


def wait_all(works: Iterable, timeout_s: float) -> None:
    """Wait for every started collective, within one shared deadline of `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    for work in works:
        work.wait(timedelta(seconds=max(0.001, deadline - time.monotonic())))


def on_loopback(host: str) -> bool:
    """Is the group's store on a loopback address? Then its members listen on loopback too.

    gloo otherwise listens where the host's name resolves (or on `GLOO_SOCKET_IFNAME`): on a
    machine whose name resolves to a LAN address, a run configured for loopback would listen
    there, open to anything that reaches the machine, with no authentication."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def piece_ranges(numel: int, ends: list[int]) -> list[tuple[int, int]]:
    """The [start, end) element ranges of consecutive pieces ending at `ends` (empty: one piece,
    the whole buffer). Raises ValueError unless they cover exactly `numel` elements in order."""
    if not ends:
        return [(0, numel)] if numel else []
    starts = [0, *ends[:-1]]
    if ends[-1] != numel or any(end <= start for start, end in zip(starts, ends)):
        raise ValueError(f"weight pieces {ends[:4]}... do not cover {numel} elements in order")
    return list(zip(starts, ends))


def broadcast_pieces(group, flat: torch.Tensor, piece_ends: list[int], timeout_s: float) -> None:
    """A receiver's side of a push: every piece into its slice of `flat`, all started at once."""
    ranges = piece_ranges(flat.numel(), piece_ends)
    works = [start_broadcast(group, flat[start:end], timeout_s) for start, end in ranges]
    wait_all(works, timeout_s)


def flat_layout(
    named_shapes: Iterable[tuple[str, tuple[int, ...]]],
) -> tuple[list[tuple[str, list[int], int]], int]:
    """Offsets (in elements) of each tensor in the flat buffer, and the total element count."""
    layout, offset = [], 0
    for name, shape in named_shapes:
        numel = 1
        for size in shape:
            numel *= size
        layout.append((name, list(shape), offset))
        offset += numel
    return layout, offset


def flat_digest(flat: torch.Tensor, chunk: int = 1 << 26) -> tuple[float, float, int]:
    """Sum and sum of magnitudes (in float64, chunk by chunk: no float64 copy of a whole model)
    and element count of a flat weight buffer: what the learner sent, or what a replica loaded."""
    total = abs_total = 0.0
    for start in range(0, flat.numel(), chunk):
        part = flat[start : start + chunk].to(torch.float64)
        total += float(part.sum())
        abs_total += float(part.abs().sum())
    return total, abs_total, flat.numel()
