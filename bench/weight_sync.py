"""Weight sync: millstream's push against a raw torch.distributed gloo broadcast of the same bytes.

    python -m millstream.bench.weight_sync [--quick] [--sizes 10,100,500,1000] [--rounds 5]

For every size (MB of float32, in 16 tensors), two systems alternate push by push
(bench/kit/rounds.py), each with one receiving process on this machine:
- `millstream`: learner/sync/weights.py as the learner's fleet uses it (bench/fleet.py section 3):
  `push_group` of the tensors (each tensor of 1 MiB or more broadcast from where it lies, smaller
  ones packed into pieces, each piece broadcast as soon as it is ready) to one synthetic actor
  replica (`python -m millstream.actor actor.kind=synthetic`), which receives into the buffer it
  keeps while it goes on making tokens, then swaps (streams its pending tokens, adopts the
  version) and answers `WeightsApplied`.
  Timed: the first pack to the last `WeightsApplied`, what a training step waits for.
  `receive_s` and `paused_s` are the replica's own: the receive with tokens still being made,
  and the swap with none.
- `gloo`: `torch.distributed.ProcessGroupGloo.broadcast` of one preallocated buffer of the same
  bytes to one receiving process that holds a preallocated buffer too: the floor of any sync
  over gloo on this machine. Timed: the broadcast call until it completes on the sender.

Metric: `mb_per_s` (MB = 2**20 bytes moved per second of the timed span); the ratio is
millstream's over gloo's.

A real engine's side (vLLM's reload of a real model, generation under way) is
bench/engine_push.py.

Memory: a 1000 MB push holds the tensors and the raw sender's copy here (2 GB), the kept buffer in
the replica (1 GB) and the raw receiver's buffer (1 GB), about 4 GB at peak. 2000 MB needs about
8 GB (`--sizes ...,2000` where there is room). Results: bench/results/<date>-<host>/
weight-sync[-quick].json, one JSON + PNG per size beside it.
"""

from __future__ import annotations

import argparse
import multiprocessing
import time
import uuid
from collections.abc import Callable
from contextlib import closing
from datetime import timedelta
from pathlib import Path
from typing import Any

import msgspec
import orjson
import torch
import torch.distributed as dist

from millstream.bench.kit.replicas import replicas
from millstream.bench.kit.rounds import Outcome, compare, machine, results_dir, write_outcome
from millstream.bench.kit.scratch import scratch
from millstream.learner.sync.layout import FlatWeights
from millstream.learner.sync.weights import ReplicaLink, attach_group, push_group
from millstream.shared.config import LearnerConfig
from millstream.shared.models.tiny import build_tiny_model
from millstream.shared.process.runtime import free_port
from millstream.shared.wire import ActorInfo, Hello

__all__ = ["main"]

MB = 2**20
TIMEOUT = timedelta(seconds=300)


def random_tensors(mb: float) -> list[tuple[str, torch.Tensor]]:
    """`mb` MB of random float32 in 16 tensors (a model's layers, roughly)."""
    piece = max(1, int(mb * MB / 4 / 16))
    gen = torch.Generator().manual_seed(0)
    return [(f"w{i}", torch.randn(piece, generator=gen)) for i in range(16)]


# --- raw gloo -------------------------------------------------------------------------------------


def _raw_receiver(port: int) -> None:
    """Rank 1 of a plain gloo group: receive the size (numel, -1 ends), then the data, forever."""
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=TIMEOUT)
    group: Any = dist.ProcessGroupGloo(store, 1, 2, TIMEOUT)  # torch's stubs lack broadcast
    size = torch.zeros(1, dtype=torch.int64)
    buffer = torch.empty(0)
    while True:
        group.broadcast(size, 0).wait()
        if int(size) < 0:
            return
        if buffer.numel() != int(size):
            buffer = torch.zeros(int(size))  # preallocated (and touched) once per size
        group.broadcast(buffer, 0).wait()


class RawGloo:
    """The sender's side of the plain gloo group, with its receiver process."""

    def __init__(self) -> None:
        port = free_port()
        self.proc = multiprocessing.get_context("spawn").Process(
            target=_raw_receiver, args=(port,), daemon=True
        )
        self.proc.start()
        store = dist.TCPStore("127.0.0.1", port, 2, is_master=True, timeout=TIMEOUT)
        self.group: Any = dist.ProcessGroupGloo(store, 0, 2, TIMEOUT)  # the stubs lack broadcast
        self.store = store

    def push(self, flat: torch.Tensor) -> float:
        """Seconds to broadcast `flat` (its size is announced first, untimed)."""
        self.group.broadcast(torch.tensor([flat.numel()], dtype=torch.int64), 0).wait()
        started = time.perf_counter()
        self.group.broadcast(flat, 0).wait()
        return time.perf_counter() - started

    def close(self) -> None:
        self.group.broadcast(torch.tensor([-1], dtype=torch.int64), 0).wait()
        self.proc.join(timeout=30)
        if self.proc.is_alive():
            self.proc.kill()


# --- one size -------------------------------------------------------------------------------------


def measure_size(mb: float, raw: RawGloo, group: Any, cfg: LearnerConfig, rounds: int) -> Outcome:
    tensors = random_tensors(mb)
    flat = FlatWeights("float32", "gloo", cfg.sync_bucket_mb)
    raw_buffer = torch.cat([t.reshape(-1) for _, t in tensors])
    nbytes = raw_buffer.numel() * raw_buffer.element_size()
    versions = iter(range(1, 10**6))
    raw.push(raw_buffer)  # warm-up of both paths: first-touch of the buffers, connections
    push_group(group, flat, tensors, next(versions), cfg)

    def ours() -> dict[str, float]:
        started = time.perf_counter()
        applied = push_group(group, flat, tensors, next(versions), cfg)
        took = time.perf_counter() - started
        receive = max(a.receive_s for a in applied)
        paused = max(a.paused_s for a in applied)
        return {"mb_per_s": nbytes / MB / took, "s": took, "receive_s": receive, "paused_s": paused}

    def gloo() -> dict[str, float]:
        took = raw.push(raw_buffer)
        return {"mb_per_s": nbytes / MB / took, "s": took}

    systems: dict[str, Callable[[], dict[str, float]]] = {"gloo": gloo, "millstream": ours}
    settings = {"mb": mb, "bytes": nbytes, "bucket_mb": cfg.sync_bucket_mb}
    return compare(systems, rounds=rounds, metric="mb_per_s", settings=settings)


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| MB | gloo s (MB/s) | millstream s (MB/s) | ratio | replica receiving s | replica paused s |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['mb']:g} | {r['gloo_s']:.3f} ({r['gloo_mb_s']:.0f}) | {r['ours_s']:.3f} "
            f"({r['ours_mb_s']:.0f}) | {r['ratio']:.2f} | {r['receive_s']:.3f} | {r['paused_s']:.3f} |"
        )
    return "\n".join(lines)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m millstream.bench.weight_sync", description=__doc__.split("\n")[0]
    )
    p.add_argument("--quick", action="store_true", help="10 and 100 MB, 3 rounds")
    p.add_argument("--sizes", default=None, help="MB, comma-separated (full: 10,100,500,1000)")
    p.add_argument("--rounds", type=int, default=None, help="pushes per system and size (full: 5)")
    p.add_argument("--bucket-mb", type=float, default=None, help="learner.sync_bucket_mb (its default)")
    p.add_argument("--out", default=None, help="results folder (bench/results/<date>-<host>/)")
    ns = p.parse_args(argv)
    ns.sizes = [float(x) for x in (ns.sizes or ("10,100" if ns.quick else "10,100,500,1000")).split(",")]
    ns.rounds = ns.rounds or (3 if ns.quick else 5)
    return ns


def main(argv: list[str] | None = None) -> Path:
    ns = parse(argv)
    folder, suffix = Path(ns.out) if ns.out else results_dir(), "-quick" if ns.quick else ""
    folder.mkdir(parents=True, exist_ok=True)
    cfg = LearnerConfig(sync_backend="gloo", sync_timeout_s=300)
    if ns.bucket_mb is not None:
        cfg = msgspec.structs.replace(cfg, sync_bucket_mb=ns.bucket_mb)
    rows: list[dict[str, Any]] = []
    with scratch("millstream-weight-sync-") as work, closing(RawGloo()) as raw:
        model = build_tiny_model(work / "tiny", seed=0)
        with replicas(1, ["actor.synthetic_step_s=0.002"], model, work) as started:
            link = ReplicaLink(started[0][0], None)
            try:
                info = link.request(Hello(f"bench-{uuid.uuid4().hex[:6]}"), ActorInfo, 30)
                group = attach_group([link], [info], cfg, "gloo")
                for mb in ns.sizes:
                    outcome = measure_size(mb, raw, group, cfg, ns.rounds)
                    write_outcome(outcome, folder, f"weight-sync-{mb:g}MB{suffix}")
                    s = outcome.summary()["systems"]
                    rows.append(
                        {
                            "mb": mb,
                            "gloo_s": s["gloo"]["s"]["median"],
                            "gloo_mb_s": s["gloo"]["mb_per_s"]["median"],
                            "ours_s": s["millstream"]["s"]["median"],
                            "ours_mb_s": s["millstream"]["mb_per_s"]["median"],
                            "ratio": outcome.ratios()["millstream"],
                            "paused_s": s["millstream"]["paused_s"]["median"],
                            "receive_s": s["millstream"]["receive_s"]["median"],
                        }
                    )
                    print(table(rows[-1:]).splitlines()[-1], flush=True)
                del group
            finally:
                link.close()
    path = folder / f"weight-sync{suffix}.json"
    payload = {"machine": machine(), "rounds": ns.rounds, "rows": rows, "table": table(rows)}
    path.write_bytes(orjson.dumps(payload, option=orjson.OPT_INDENT_2))
    print(table(rows))
    print(f"paused_s (median) per size: {[round(r['paused_s'], 3) for r in rows]}; {path}")
    return path


if __name__ == "__main__":
    main()
