"""envpool against the asyncio + HTTP pattern: turns/s, p99 turn latency, memory per episode.

    python -m millstream.bench.pool_vs_http [--quick] [--rounds 3] [--concurrency 100,1000,10000]
                                            [--against OTHER_CHECKOUT]

Both sides play the same episodes (the `echo` environment, 2 turns, 24 tokens a reply) against
the same engine: the synthetic actor's engine model (actor/synthetic.py), set so that it is never
the bottleneck (`ENGINE`: no step or prefill time, no batch limit to speak of):

- **envpool**: `millstream stress` (bench/stress.py): one envpool worker process (trio, ZeroMQ
  with CURVE, msgspec, the chat template, token in / token out, trajectories pushed to a
  stand-in learner), the synthetic actor process over the real protocol;
- **asyncio-http**: one asyncio process running the episodes as coroutines, one aiohttp POST of
  JSON per turn to the same engine model served over HTTP (bench/baselines/http_engine.py). It does the
  same tokenizer work (envpool's `ChatFormat`: the first prompt, the close and the next prompt
  each turn, the reply decoded once) and runs the same `Echo` environment code, but builds no
  trajectory and sends nothing on.

Turns/s is counted by each side the same way (bench/kit/stress_report.py `ResultWindow`): the turns
of the episodes that ended after the first one, over the time from the first to the last, so
neither side's process start (imports, tokenizer, handshakes) is in it; the wall-clock rate is
kept as `turns_s_wall`. Where envpool itself saturates: its turns/s as concurrency grows.
Memory per live episode: the process's resident memory at the peak of live episodes, less
before, over that peak.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import aiohttp

from millstream.bench.kit.rounds import compare, results_dir, write_outcome
from millstream.bench.kit.scratch import scratch
from millstream.bench.kit.stress_report import ResultWindow
from millstream.bench.stress import stress_once
from millstream.envpool.chat import ChatFormat
from millstream.envpool.envs import make_env
from millstream.envpool.stats import rss_bytes
from millstream.shared.models.tiny import build_tiny_model
from millstream.shared.process.runtime import free_port

__all__ = ["main"]

TURNS, MAX_TOKENS = 2, 24


#: The synthetic engine both sides talk to, set so that it is never the bottleneck: no batch
#: limit to speak of, no step or prefill time, no stop chance of its own (a reply ends at
#: MAX_TOKENS or on a uniformly drawn stop id of the chat template, the same ones both sides).
ENGINE = [
    "actor.max_num_seqs=100000",
    "actor.synthetic_step_s=0",
    "actor.synthetic_step_s_per_seq=0",
    "actor.synthetic_prefill_s_per_token=0",
    "actor.synthetic_stop_prob=0",
]


def _envpool_args(model: Path, concurrency: int, episodes: int) -> list[str]:
    args = ["--env", "echo", "--episodes", str(episodes), "--concurrency", str(concurrency)]
    args += [
        "--actor",
        "synthetic",
        "--set",
        f"model.path={model}",
        "--set",
        f"envpool.max_tokens={MAX_TOKENS}",
    ]
    for setting in ENGINE:
        args += ["--set", setting]
    return args


def through_envpool(model: Path, concurrency: int, episodes: int) -> dict[str, float]:
    return _envpool_numbers(stress_once(_envpool_args(model, concurrency, episodes)))


def through_checkout(tree: Path, model: Path, concurrency: int, episodes: int) -> dict[str, float]:
    """The same run by another checkout's envpool (its own `.venv`): before and after a change,
    interleaved in the same minutes."""
    code = (
        "import json; from millstream.bench.stress import stress_once; "
        f"print(json.dumps(stress_once({_envpool_args(model, concurrency, episodes)!r})))"
    )
    done = subprocess.run(
        [str(tree / ".venv" / "bin" / "python"), "-c", code],
        cwd=tree,
        capture_output=True,
        text=True,
        timeout=1800,
        check=True,
    )
    import json

    return _envpool_numbers(json.loads(done.stdout.strip().splitlines()[-1]))


def _envpool_numbers(report: dict) -> dict[str, float]:
    per_episode = report["bytes_per_live_episode"] or 0.0
    # CPU microseconds per turn of each process (the worker, the synthetic actor, the driver);
    # absent in reports of checkouts from before `millstream stress` measured it.
    per_turn = report.get("cpu", {}).get("us_per_turn", {})
    return {
        "turns_s": float(report["steady"]["turns_per_s"]),
        "turns_s_wall": float(report["turns_per_s"]),
        "p99_ms": 1000 * float(report["turn_latency_s"]["p99"]),
        "kib_per_episode": per_episode / 1024,
    } | {f"cpu_us_per_turn_{name}": float(us) for name, us in per_turn.items()}


async def _http_episodes(url: str, chat: ChatFormat, concurrency: int, episodes: int) -> dict[str, float]:
    latencies: list[float] = []
    turns = live = peak_live = 0
    base_rss = peak_rss = rss_bytes()
    next_seed = iter(range(episodes))
    window = ResultWindow()
    stops = list(chat.stop_token_ids)  # as envpool's requests carry them

    async def episode(session: aiohttp.ClientSession, seed: int) -> None:
        nonlocal turns, live, peak_live, peak_rss
        env = make_env("echo", {"turns": TURNS})
        live += 1
        if live > peak_live:
            peak_live, peak_rss = live, max(peak_rss, rss_bytes())
        obs = await env.reset(seed)
        ids = chat.first_prompt("", obs.text)
        played = 0
        for _ in range(TURNS):
            sent = time.perf_counter()
            async with session.post(
                url, json={"prompt_token_ids": ids, "max_tokens": MAX_TOKENS, "stop_token_ids": stops}
            ) as r:
                reply = await r.json()
            latencies.append(time.perf_counter() - sent)
            result = await env.step(chat.decode(reply["token_ids"]))
            turns, played = turns + 1, played + 1
            if result.done:
                break
            ids = (
                ids
                + reply["token_ids"]
                + chat.close_turn(reply["token_ids"])
                + chat.next_prompt(result.observation.text)
            )
        live -= 1
        window.saw(played)

    async def client(session: aiohttp.ClientSession) -> None:
        for seed in next_seed:
            await episode(session, seed)

    connector = aiohttp.TCPConnector(limit=concurrency)
    started = time.perf_counter()
    async with aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=600)
    ) as session:
        await asyncio.gather(*(client(session) for _ in range(concurrency)))
    wall = time.perf_counter() - started
    latencies.sort()
    return {
        "turns_s": window.summary()["turns_per_s"],
        "turns_s_wall": turns / wall,
        "p99_ms": 1000 * latencies[int(0.99 * (len(latencies) - 1))],
        "kib_per_episode": (peak_rss - base_rss) / max(peak_live, 1) / 1024,
    }


def through_http(url: str, model: Path, concurrency: int, episodes: int) -> dict[str, float]:
    """One asyncio process per sample (fresh memory, as envpool's worker process is)."""
    code = (
        "import asyncio, json, sys; from millstream.bench.pool_vs_http import _http_episodes; "
        "from millstream.envpool.chat import ChatFormat; "
        f"print(json.dumps(asyncio.run(_http_episodes({url!r}, ChatFormat.from_model_dir({str(model)!r}), "
        f"{concurrency}, {episodes}))))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=1800, check=True
    )
    import json

    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m millstream.bench.pool_vs_http", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--quick", action="store_true", help="concurrency 100 and 1,000")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--concurrency", default="100,1000,10000")
    p.add_argument("--episodes", type=int, default=0, help="per sample (default 10,000, or 2x concurrency)")
    p.add_argument("--out", type=Path, default=None, help="default bench/results/<date>-<host>")
    p.add_argument(
        "--against",
        type=Path,
        default=None,
        help="another checkout (with its .venv) whose envpool runs as a third system, 'envpool-before'",
    )
    ns = p.parse_args(argv)
    levels = [100, 1000] if ns.quick else [int(c) for c in ns.concurrency.split(",")]
    least = ns.episodes or (3000 if ns.quick else 10_000)
    out = ns.out or results_dir()
    with scratch("millstream-pool-vs-http-") as work:
        model = build_tiny_model(work / "tiny", seed=0)
        port = free_port()
        server = subprocess.Popen(
            [sys.executable, "-m", "millstream.bench.baselines.http_engine", str(port), str(model), *ENGINE],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert server.stdout is not None
            server.stdout.readline()  # "ready"
            url = f"http://127.0.0.1:{port}/generate"
            for concurrency in levels:
                episodes = max(least, 2 * concurrency)
                systems: dict[str, Callable[[], dict[str, float]]] = {
                    "envpool": partial(through_envpool, model, concurrency, episodes),
                    "asyncio-http": partial(through_http, url, model, concurrency, episodes),
                }
                if ns.against is not None:
                    before = partial(through_checkout, ns.against, model, concurrency, episodes)
                    systems["envpool-before"] = before
                outcome = compare(
                    systems,
                    rounds=ns.rounds,
                    metric="turns_s",
                    settings={
                        "concurrency": concurrency,
                        "episodes": episodes,
                        "env": "echo",
                        "turns": TURNS,
                        "against": str(ns.against) if ns.against else None,
                    },
                )
                name = f"pool-vs-http-c{concurrency}" + ("-quick" if ns.quick else "")
                name += "-ab" if ns.against else ""
                write_outcome(outcome, out, name)
                e, h = (outcome.summary()["systems"][s] for s in ("envpool", "asyncio-http"))
                print(
                    f"| {concurrency} | {e['turns_s']['median']:,.0f} | {h['turns_s']['median']:,.0f} "
                    f"| {e['p99_ms']['median']:,.0f} | {h['p99_ms']['median']:,.0f} "
                    f"| {e['kib_per_episode']['median']:.1f} | {h['kib_per_episode']['median']:.1f} |",
                    flush=True,
                )
        finally:
            server.terminate()
            server.wait(10)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
