"""Actor replicas as processes, for the benchmarks that need them (fleet, weight_sync, engine_push).

    with replicas(4, ["actor.synthetic_step_s=0.02"], model_dir, work) as started:
        addresses = [address for address, pid in started]

Each replica is `python -m millstream.actor actor.kind=synthetic` (or another kind, by override)
on loopback with `transport.curve=false`, in a process group of its own in this session
(bench/kit/spawn.py), started together, killed on exit with everything it started (nothing to
drain: a benchmark's turns are over by then). Also the synthetic replica's digest time.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from millstream.bench.kit.spawn import spawn, stop
from millstream.shared.process.runtime import free_port

__all__ = ["replicas", "digest_s"]

ROOT = Path(__file__).resolve().parent.parent.parent  # the repository (bench/kit/ -> ..)


@contextmanager
def replicas(count: int, overrides: list[str], model: Path, work: Path) -> Iterator[list[tuple[str, int]]]:
    """`count` synthetic actor processes, started together; yields [(address, pid)]."""
    procs: list[tuple[str, subprocess.Popen, Path]] = []
    try:
        for _ in range(count):
            address = f"tcp://127.0.0.1:{free_port()}"
            ready = work / f"ready-{address.rsplit(':', 1)[1]}.json"
            cmd = [
                sys.executable, "-m", "millstream.actor", "--ready-file", str(ready),
                f"model.path={model}", f"actor.address={address}", "actor.kind=synthetic",
                "transport.curve=false", "run.log_level=WARNING", *overrides,
            ]  # fmt: skip
            with (work / f"actor-{len(procs)}.log").open("wb") as log:
                proc = spawn(cmd, stdout=log, stderr=log, cwd=ROOT)
            procs.append((address, proc, ready))
        deadline = time.monotonic() + 300
        for k, (_, proc, ready) in enumerate(procs):
            while not ready.exists():
                if proc.poll() is not None or time.monotonic() > deadline:
                    tail = (work / f"actor-{k}.log").read_text()[-2000:]
                    raise RuntimeError(f"synthetic actor {k} did not start:\n{tail}")
                time.sleep(0.1)
        yield [(address, proc.pid) for address, proc, _ in procs]
    finally:
        for _, proc, _ in procs:  # nothing to drain: the benchmark's turns are over
            # The whole group: a vLLM actor's engine processes are its children, and a
            # SIGKILL of the actor alone left them running (3 GB each) after every benchmark.
            stop(proc, grace_s=0)


def digest_s(flat: torch.Tensor | None) -> float:
    """The synthetic replica's weight digest of `flat` (actor/synthetic.py), timed here (best of
    3): the part of its push time that a real engine's load replaces."""
    assert flat is not None
    times = []
    for _ in range(3):
        started = time.perf_counter()
        as64 = flat.to(torch.float64)
        float(as64.sum()), float(as64.abs().sum())
        times.append(time.perf_counter() - started)
    return min(times)
