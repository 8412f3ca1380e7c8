"""A fleet of actor replicas: throughput by replica count, router overhead, weight sync time.

    python -m millstream.bench.fleet [--quick] [--rounds 3] [--replicas 1,2,4,8] [--sync-replicas 1,2,4,8]

All through the production code, on loopback with `transport.curve=false`:

1. **Throughput.** Synthetic actor processes (`python -m millstream.actor actor.kind=synthetic`,
   one set per value of `--step-s`): `--max-num-seqs` slots, that decode step time, no other
   cost, every turn exactly `--max-tokens` tokens. One replica then makes at most
   max_num_seqs / step_s tokens/s: the replicas are the bottleneck, not the client. For each N,
   an envpool `Router` (envpool/actors/router.py) over the first N replicas serves `--episodes`
   concurrent loops of episodes of `--turns` sticky turns (the prompt grows by each reply), the
   same offered load for every N. After `--warmup` s, turns, tokens and CPU seconds (this
   process; all replicas, from /proc) are counted for `--duration` s. Then the router's own cost
   per turn is timed with every replica's `generate_once` replaced by a stub that answers at once.
   The replica counts alternate round by round (bench/kit/rounds.py, `--rounds`): fleet.json keeps
   the sample of median tokens/s per N, and `fleet-throughput-<step>ms.json` + .png every sample.
2. **Router overhead, end to end.** One replica with a zero-cost engine, one-token turns, one at
   a time. In one event loop, `Router.generate` and a bare `ActorClient.generate_once` (each with
   its own socket) alternate in blocks of `--overhead-turns`: wall and CPU µs per turn of this
   process. Overhead: the difference of the means; spread over `--repeats` block pairs.
3. **Weight sync.** For each N of `--sync-replicas`, learner/sync/weights.py as the fleet uses it:
   `attach_group` (learner + N replicas, gloo), timed as group formation, then `--pushes` times
   `push_group` (as `Fleet.push`: packing and broadcasting overlap) of the tiny model's tensors
   (~1.7 MB) and of `--big-mb` MB of random float32: what a training step waits for its weights
   to reach every replica.

Caveats:
- The recorded numbers (bench/README.md) come from a shared 2-core box where others run tests:
  noisy, and replicas, client and gloo compete for the same two cores.
- The synthetic engine sleeps through its timing model: throughput measures the router and the
  protocol, not an engine; but each replica's Python per step is real CPU.
- gloo's broadcast (ProcessGroupGloo -> gloo::broadcast) is a binomial tree of whole-buffer
  sends: about ceil(log2(N + 1)) rounds of the buffer, not N. NCCL on GPUs pipelines a
  ring/tree. Each synthetic replica receives into a buffer it keeps and sums it (its weight
  digest) only when asked; `digest_s` is what that sum costs once.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import orjson
import torch
from safetensors.torch import load_file

from millstream.bench.kit.fleet_report import plot, table
from millstream.bench.kit.procstat import cpu_s
from millstream.bench.kit.replicas import digest_s, replicas
from millstream.bench.kit.rounds import compare, results_dir, write_outcome
from millstream.bench.kit.scratch import scratch
from millstream.envpool.actors.client import ActorClient, Generation
from millstream.envpool.actors.generation import Retry, Sampling
from millstream.envpool.actors.router import Router
from millstream.learner.sync.layout import FlatWeights
from millstream.learner.sync.weights import ReplicaLink, attach_group, push_group
from millstream.shared.config import LearnerConfig, TransportConfig
from millstream.shared.models.tiny import build_tiny_model
from millstream.shared.wire import ActorInfo, Hello, ReplicaRef
from millstream.shared.wire.transport import open_channel

__all__ = ["main"]

TRANSPORT = TransportConfig(curve=False)
VERSIONS = itertools.count(1)  # policy versions pushed, increasing across groups


# --- 1. throughput ----------------------------------------------------------------------------


def _router(addresses: list[str]) -> Router:
    router = Router(TRANSPORT, "bench", None, addresses[0])
    router.update([ReplicaRef(f"r{i}", a, 1) for i, a in enumerate(addresses)])  # at `run`
    return router


async def _wait_usable(router: Router) -> None:
    with anyio.fail_after(30):
        while not router.replicas or not all(router.usable(r) for r in router.replicas.values()):
            await anyio.sleep(0.02)


async def _episodes(router: Router, ns: argparse.Namespace, counts: dict[str, int]) -> None:
    """`ns.episodes` concurrent loops of episodes of `ns.turns` sticky turns, forever."""

    async def loop(i: int) -> None:
        for n in range(10**9):
            episode, prompt = f"e{i}-{n}", [1 + i % 50, 2, 3, 4]
            for _ in range(ns.turns):
                gen = await router.generate(
                    prompt, Sampling(max_tokens=ns.max_tokens, timeout_s=120), seed=None,
                    retry=Retry(3, 0.1), affinity=episode,
                )  # fmt: skip
                counts["turns"] += 1
                counts["tokens"] += len(gen.token_ids)
                prompt = prompt + gen.token_ids
            router.release(episode)

    async with anyio.create_task_group() as tg:
        for i in range(ns.episodes):
            tg.start_soon(loop, i)


def _snapshot(counts: dict[str, int], pids: list[int]) -> list[float]:
    """Wall clock, this process's CPU, the replicas' CPU, turns and tokens so far."""
    replicas_cpu = sum(cpu_s(p) for p in pids)
    return [time.perf_counter(), time.process_time(), replicas_cpu, counts["turns"], counts["tokens"]]


async def _throughput(replicas: list[tuple[str, int]], step: float, ns: argparse.Namespace) -> dict[str, Any]:
    counts, pids = {"turns": 0, "tokens": 0}, [pid for _, pid in replicas]
    router = _router([a for a, _ in replicas])
    async with anyio.create_task_group() as tg:
        tg.start_soon(router.run)
        await _wait_usable(router)
        async with anyio.create_task_group() as load:
            load.start_soon(_episodes, router, ns, counts)
            await anyio.sleep(ns.warmup)
            start = _snapshot(counts, pids)
            await anyio.sleep(ns.duration)
            end = _snapshot(counts, pids)
            load.cancel_scope.cancel()
        await anyio.sleep(0.3)  # the cancelled turns' Aborts reach the replicas
        stats = router.statistics()
        own_us = await _router_cost(router, 10 * ns.overhead_turns)
        tg.cancel_scope.cancel()
    wall, client_cpu, replicas_cpu, turns, tokens = (e - s for s, e in zip(start, end))
    served = [r["tokens"] for r in stats["replicas"].values()]
    share = [t / max(1, sum(served)) for t in served]
    return {
        "replicas": len(replicas),
        "step_s": step,
        "wall_s": wall,
        "turns": int(turns),
        "tokens": int(tokens),
        "turns_per_s": turns / wall,
        "tokens_per_s": tokens / wall,
        "client_cpu": client_cpu / wall,  # cores busy, on average, in this process
        "replicas_cpu": replicas_cpu / wall,  # and in all replica processes together
        "token_share_min_max": [min(share), max(share)],
        "retries_by_cause": stats["retries_by_cause"],
        "episodes_moved": stats["episodes_moved"],
        "router_own_us": own_us,
    }


# --- 2. router overhead -----------------------------------------------------------------------

_ONE_TOKEN = Sampling(max_tokens=1, timeout_s=30)


async def _block(turn: Callable[[int], Awaitable[Any]], turns: int) -> tuple[float, float]:
    """Wall and CPU µs per turn of `turns` sequential calls of `turn(i)`."""
    wall, cpu = time.perf_counter(), time.process_time()
    for i in range(turns):
        await turn(i)
    return (time.perf_counter() - wall) / turns * 1e6, (time.process_time() - cpu) / turns * 1e6


def _routed(router: Router) -> Callable[[int], Awaitable[None]]:
    """Turn `i` of episodes of 4 turns through `router`."""

    async def turn(i: int) -> None:
        await router.generate([1, 2, 3, 4], _ONE_TOKEN, seed=None, affinity=f"e{i // 4}")
        if i % 4 == 3:
            router.release(f"e{i // 4}")

    return turn


async def _router_cost(router: Router, turns: int) -> float:
    """µs per turn that `Router.generate` itself costs (picking, counting, timing): every
    replica's `generate_once` replaced by a stub that answers at once, less the stub's own cost."""

    async def stub(*args: Any, **kwargs: Any) -> Generation:
        return Generation([7], [-1.0], [0], "stop")

    for replica in router.replicas.values():
        replica.client.generate_once = stub  # type: ignore[method-assign]
    routed_us = min([(await _block(_routed(router), turns))[0] for _ in range(3)])
    stub_us = min([(await _block(lambda i: stub(), turns))[0] for _ in range(3)])
    return routed_us - stub_us


async def _overhead(address: str, ns: argparse.Namespace) -> dict[str, Any]:
    router = _router([address])
    channel = open_channel("dealer", address, bind=False, cfg=TRANSPORT, keys=None)
    bare = ActorClient(channel, "bare")
    routed = _routed(router)

    async def direct(i: int) -> None:
        await bare.generate_once([1, 2, 3, 4], _ONE_TOKEN, seed=None)

    rows: dict[str, list[tuple[float, float]]] = {"router": [], "bare": []}
    async with anyio.create_task_group() as tg:
        for task in (router.run, channel.run, bare.run):
            tg.start_soon(task)
        await _wait_usable(router)
        await _block(routed, 200)  # warm-up: connections, caches
        await _block(direct, 200)
        for i in range(ns.repeats):  # alternating which goes first
            for name in ("router", "bare")[:: 1 if i % 2 else -1]:
                rows[name].append(await _block(routed if name == "router" else direct, ns.overhead_turns))
        tg.cancel_scope.cancel()
    channel.sock.close(linger=0)
    out: dict[str, Any] = {"turns_per_block": ns.overhead_turns, "repeats": ns.repeats, "blocks": rows}
    for k, what in ((0, "wall"), (1, "cpu")):
        diffs = [r[k] - b[k] for r, b in zip(rows["router"], rows["bare"])]
        out[f"{what}_us"] = {
            "router_mean": statistics.fmean(r[k] for r in rows["router"]),
            "bare_mean": statistics.fmean(b[k] for b in rows["bare"]),
            "overhead_mean": statistics.fmean(diffs),
            "overhead_median": statistics.median(diffs),
            "overhead_stdev": statistics.stdev(diffs) if len(diffs) > 1 else 0.0,
        }
    return out


# --- 3. weight sync ---------------------------------------------------------------------------


def payloads(model: Path, big_mb: float) -> dict[str, list[tuple[str, torch.Tensor]]]:
    """The tiny model's tensors, and `big_mb` MB of random float32 tensors in 16 pieces."""
    tiny = sorted(load_file(str(model / "model.safetensors")).items())
    piece = max(1, int(big_mb * 2**20 / 4 / 16))
    gen = torch.Generator().manual_seed(0)
    big = [(f"w{i}", torch.randn(piece, generator=gen)) for i in range(16)]
    return {"tiny": [(n, t.float()) for n, t in tiny], f"random-{big_mb:g}MB": big}


def sync_times(addresses: list[str], loads: dict[str, Any], ns: argparse.Namespace) -> dict[str, Any]:
    """Form one group with `addresses`, push each payload `ns.pushes` times."""
    cfg = LearnerConfig(sync_backend="gloo", sync_timeout_s=120)
    links = [ReplicaLink(a, None) for a in addresses]
    try:
        infos = [link.request(Hello("bench"), ActorInfo, 30) for link in links]
        started = time.perf_counter()
        group = attach_group(links, infos, cfg, "gloo")
        out: dict[str, Any] = {"replicas": len(links), "form_s": time.perf_counter() - started, "push": {}}
        for name, tensors in loads.items():
            flat = FlatWeights("float32", "gloo", cfg.sync_bucket_mb)
            times, paused = [], []
            for _ in range(ns.pushes):  # as Fleet.push: pack and broadcast, wait for all
                started = time.perf_counter()
                applied = push_group(group, flat, tensors, next(VERSIONS), cfg)
                times.append(time.perf_counter() - started)
                paused.append(max(a.paused_s for a in applied))
            out["push"][name] = {
                "bytes": flat.nbytes,
                "median_s": statistics.median(times),
                "min_max_s": [min(times), max(times)],
                "paused_median_s": statistics.median(paused),
                "digest_s": digest_s(torch.cat([t.reshape(-1) for _, t in tensors])),
                "all_s": times,
            }
        del group
        return out
    finally:
        for link in links:
            link.close()


def _numbers(kind: Callable[[str], Any]) -> Callable[[str], list[Any]]:
    return lambda text: [kind(x) for x in text.split(",") if x]


#: `--quick`: the same questions, smaller (about a minute here).
QUICK = dict(
    step_s=[0.02], sync_replicas=[1, 2], warmup=0.5, duration=2.0, overhead_turns=200, repeats=4,
    pushes=3, big_mb=10.0,
)  # fmt: skip


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m millstream.bench.fleet", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help=f"smaller: {QUICK}")
    p.add_argument("--rounds", type=int, default=3, help="rounds of the throughput comparison")
    p.add_argument("--replicas", type=_numbers(int), default=[1, 2, 4, 8], help="replica counts (throughput)")
    p.add_argument("--sync-replicas", type=_numbers(int), default=[1, 2, 4, 8], help="replica counts (sync)")
    p.add_argument("--episodes", type=int, default=128, help="concurrent episodes, every N")
    p.add_argument("--turns", type=int, default=4, help="turns per episode")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens per turn (always all of them)")
    p.add_argument("--max-num-seqs", type=int, default=8, help="synthetic engine slots per replica")
    p.add_argument("--step-s", type=_numbers(float), default=[0.02, 0.002], help="decode step times, s")
    p.add_argument("--warmup", type=float, default=1.0, help="seconds before counting")
    p.add_argument("--duration", type=float, default=5.0, help="seconds counted per replica count")
    p.add_argument("--overhead-turns", type=int, default=1000, help="turns per overhead block")
    p.add_argument("--repeats", type=int, default=10, help="router/bare block pairs")
    p.add_argument("--pushes", type=int, default=5, help="pushes per payload and replica count")
    p.add_argument("--big-mb", type=float, default=100, help="size of the random payload, MB")
    p.add_argument("--out", default=None, help="fleet.json, fleet.png go here (bench/results/<date>-<host>/)")
    ns = p.parse_args(argv)
    if ns.quick:
        given = {a.split("=")[0].lstrip("-").replace("-", "_") for a in (argv or sys.argv[1:])}
        for key, value in QUICK.items():
            if key not in given:  # an explicit option wins over the quick size
                setattr(ns, key, value)
    return ns


def _numeric(row: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in row.items() if isinstance(v, (int, float))}


def throughput_rounds(
    started: list[tuple[str, int]], step: float, ns: argparse.Namespace
) -> list[dict[str, Any]]:
    """Every N of `ns.replicas`, alternating round by round; per N the sample of median tokens/s."""
    rows: dict[str, list[dict[str, Any]]] = {f"{n} replicas": [] for n in ns.replicas}

    def system(n: int) -> Callable[[], dict[str, float]]:
        def once() -> dict[str, float]:
            row = anyio.run(_throughput, started[:n], step, ns, backend="trio")
            rows[f"{n} replicas"].append(row)
            return _numeric(row)

        return once

    systems = {f"{n} replicas": system(n) for n in ns.replicas}
    settings = {"step_s": step, "max_num_seqs": ns.max_num_seqs, "episodes": ns.episodes, "turns": ns.turns}
    outcome = compare(systems, rounds=ns.rounds, metric="tokens_per_s", settings=settings)
    name = f"fleet-throughput-{step * 1000:g}ms{'-quick' if ns.quick else ''}"
    write_outcome(outcome, Path(ns.out), name)
    return [sorted(r, key=lambda x: x["tokens_per_s"])[(len(r) - 1) // 2] for r in rows.values()]


def measure(ns: argparse.Namespace, work: Path) -> dict[str, Any]:
    model = build_tiny_model(work / "tiny", seed=0)
    zero = [f"actor.synthetic_{k}=0" for k in ("step_s_per_seq", "prefill_s_per_token", "stop_prob")]
    engine = [f"actor.max_num_seqs={ns.max_num_seqs}", "actor.synthetic_step_s={step}", *zero]
    results: dict[str, Any] = {"args": vars(ns), "cpus": os.cpu_count(), "load_before": os.getloadavg()}
    results |= {"engine": engine, "throughput": [], "sync": []}
    for i, step in enumerate(ns.step_s):  # the first set of replicas also serves the sync
        count = max(ns.replicas + (ns.sync_replicas if i == 0 else []))
        with replicas(count, [e.format(step=step) for e in engine], model, work) as started:
            results["throughput"] += throughput_rounds(started, step, ns)
            if i == 0:
                loads = payloads(model, ns.big_mb)
                results["sync"] = [
                    sync_times([a for a, _ in started[:n]], loads, ns) for n in ns.sync_replicas
                ]
    with replicas(1, ["actor.synthetic_step_s=0", *zero[:2]], model, work) as ((address, _),):
        results["overhead"] = anyio.run(_overhead, address, ns, backend="trio")
    return results


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ns, begun = parse(argv), time.perf_counter()
    ns.out = ns.out or str(results_dir())
    with scratch("millstream-fleet-bench-") as work:
        results = measure(ns, work)
    results["total_s"], results["load_after"] = time.perf_counter() - begun, os.getloadavg()
    results["title"] = (
        f"synthetic replicas: {ns.max_num_seqs} slots, {ns.max_tokens} tokens/turn, {ns.episodes} "
        f"episodes of {ns.turns} turns; {results['cpus']} CPUs (shared); {results['total_s']:.0f} s in all"
    )
    out, name = Path(ns.out), "fleet-quick" if ns.quick else "fleet"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_bytes(orjson.dumps(results, option=orjson.OPT_INDENT_2))
    plot(results, out / f"{name}.png")
    print(table(results))
    print(f"total {results['total_s']:.0f} s; {out / name}.json, {out / name}.png")
    return results


if __name__ == "__main__":
    main()
