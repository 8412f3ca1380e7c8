"""What CURVE authentication costs: generation throughput through a real actor, with and without.

    python -m millstream.bench.auth_cost [--actor vllm|synthetic] [--requests 256] [--concurrency 64]

For each setting (`transport.curve = true`, then `false`) it starts the actor as a process
(`python -m millstream.actor`, the tiny model, keys in a temporary folder), sends `--requests`
generations of `--max-tokens` tokens from `--concurrency` tasks over one DEALER (as an envpool
worker does), and reports generated tokens per second and the turn latency. The rounds alternate
(on, off, on, off, ...) so a slow moment of the machine does not land on one setting only.

`millstream stress --set transport.curve=false` measures the same for the envpool's turns/s
(bench/README.md records both).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path

import anyio
import orjson

from millstream.bench.kit.scratch import scratch
from millstream.bench.kit.spawn import spawn, stop
from millstream.envpool.actors.client import ActorClient
from millstream.envpool.actors.generation import Sampling
from millstream.shared.config import Config, TransportConfig
from millstream.shared.models.tiny import build_tiny_model
from millstream.shared.process.runtime import free_port
from millstream.shared.wire.keys import load_keys
from millstream.shared.wire.transport import open_channel

__all__ = ["main"]


def _start_actor(kind: str, model: Path, keys: Path, curve: bool, work: Path) -> tuple[str, subprocess.Popen]:
    address = f"tcp://127.0.0.1:{free_port()}"
    ready = work / f"ready-{address.rsplit(':', 1)[1]}.json"
    cmd = [
        sys.executable, "-m", "millstream.actor", "--ready-file", str(ready), f"model.path={model}",
        f"actor.address={address}", f"actor.kind={kind}", f"transport.curve={'true' if curve else 'false'}",
        f"transport.keys_dir={keys}", "actor.max_num_seqs=64", "run.log_level=WARNING",
    ]  # fmt: skip
    with (work / f"actor-{'curve' if curve else 'plain'}.log").open("wb") as log:
        proc = spawn(cmd, stdout=log, stderr=log)
    deadline = time.monotonic() + 600
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            stop(proc, grace_s=0)  # its group: an engine process it started goes too
            raise RuntimeError(f"the actor did not start ({' '.join(cmd)})")
        time.sleep(0.2)
    return address, proc


async def _load(address: str, curve: bool, keys: Path, requests: int, concurrency: int, max_tokens: int):
    cfg = TransportConfig(curve=curve, keys_dir=str(keys))
    channel = open_channel(
        "dealer", address, bind=False, cfg=cfg, keys=load_keys(Config(transport=cfg), "envpool")
    )
    client = ActorClient(channel, "bench")
    tokens, latencies = 0, []
    todo = iter(range(requests))

    async def one_task() -> None:
        nonlocal tokens
        for i in todo:
            started = time.perf_counter()
            gen = await client.generate(
                [1 + i % 50, 2, 3, 4, 5, 6, 7, 8], Sampling(max_tokens=max_tokens, timeout_s=300), seed=i
            )
            tokens += len(gen.token_ids)
            latencies.append(time.perf_counter() - started)

    async with anyio.create_task_group() as io:
        io.start_soon(channel.run)
        io.start_soon(client.run)
        await client.handshake(timeout_s=30, retries=3, backoff_s=1)
        started = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for _ in range(concurrency):
                tg.start_soon(one_task)
        wall = time.perf_counter() - started
        io.cancel_scope.cancel()
    return tokens / wall, statistics.median(latencies)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="millstream.bench.auth_cost", description=__doc__.split("\n")[0])
    parser.add_argument("--actor", choices=["vllm", "synthetic"], default="vllm")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2, help="rounds per setting, alternating")
    ns = parser.parse_args(argv)
    results: dict[str, list[tuple[float, float]]] = {"curve": [], "plain": []}
    actors = {}
    with scratch("millstream-auth-cost-") as work, ExitStack() as stack:
        model = build_tiny_model(work / "tiny", seed=0)
        keys = work / "keys"
        for curve in (True, False):  # both actors up first: the rounds then alternate
            kind = "vllm" if ns.actor == "vllm" else "synthetic"
            actors[curve] = _start_actor(kind, model, keys, curve, work)
            stack.callback(stop, actors[curve][1], grace_s=60)
        for _ in range(ns.rounds):
            for curve in (True, False):
                address = actors[curve][0]
                rate, p50 = anyio.run(_load, address, curve, keys, ns.requests, ns.concurrency, ns.max_tokens)
                results["curve" if curve else "plain"].append((rate, p50))
    print(f"{'setting':<8} {'tokens/s (each round)':<28} {'median turn s':<14}")
    for name, rows in results.items():
        rates = ", ".join(f"{r:.0f}" for r, _ in rows)
        print(f"{name:<8} {rates:<28} {statistics.median(p for _, p in rows):.3f}")
    print(orjson.dumps({"actor": ns.actor, **vars(ns), "results": results}).decode())


if __name__ == "__main__":
    main()
