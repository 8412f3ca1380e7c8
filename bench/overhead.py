"""millstream's overhead against the engine alone: generated tokens/s, three ways, one model.

    python -m millstream.bench.overhead [--quick] [--rounds 3] [--concurrency 64,256]
        [--systems millstream,vllm-serve[,asyncllm-again]] [--instances 1]

The same tiny Qwen2 model (float32, CPU), the same engine settings (batch width, KV budget, whole
prompt prefill: the actor's `build_engine`; its EngineCore's priority), the same prompts and
exactly the same output lengths (`ignore_eos`, `min_tokens`), temperature 1, the sampled
token's logprob, through:

- **millstream**: the actor process (`python -m millstream.actor`), driven over ZeroMQ with CURVE
  by envpool's `ActorClient` (trio): streamed deltas with logprobs and policy versions, as every
  episode turn is;
- **asyncllm**: vLLM's `AsyncLLM` driven directly in one process (bench/baselines/overhead_engine.py);
- **vllm-serve**: vLLM's OpenAI server, driven by an asyncio + httpx client (the pattern most
  peers use: one HTTP request per turn, `/v1/completions` with the prompt's token ids).

Each load shape (bench/baselines/overhead_load.py: waves, closed loop) and concurrency is one comparison,
the three systems interleaved round by round (bench/kit/rounds.py); all three engines stay up for
the whole run, started one at a time, and only the measured one runs: the other two are
stopped (SIGSTOP of their process groups, `OneAwake`), because an idle vLLM CPU engine keeps
spinning for a second after its last step and takes cores from the measured one. Ratios are of
median tokens/s against asyncllm; each sample also records the CPU time of every process under
the benchmark per thousand tokens (with all cores busy it only mirrors tokens/s) and, for the two
systems that stream, the time to each request's first token (median and 90th percentile).

Each ratio also comes paired, round by round (`paired_ratios`: each round's sample over the
reference's of the same round), and `--systems asyncllm-again` adds the A/A control: a second
AsyncLLM process, the same engine and command as the reference, whose ratio to the
reference says how far two identical engines differ on this machine in one run.
`--instances N` starts every engine afresh N times (in the opposite order every other time),
runs `--rounds` with each set, and pools the samples: a ratio then rests on N starts of each
engine, not on one.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import ExitStack, suppress
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import httpx

from millstream.bench.baselines.overhead_engines import (
    lower_baseline_cores,
    read_json_line,
    start_actor,
    start_asyncllm,
    start_vllm_serve,
)
from millstream.bench.baselines.overhead_load import prompt_ids, run_load
from millstream.bench.kit.procstat import labelled_threads, thread_cpu_s, thread_wait_s, tree_cpu_s
from millstream.bench.kit.rounds import Outcome, compare, pooled, results_dir, write_outcome
from millstream.bench.kit.scratch import scratch
from millstream.envpool.actors.client import ActorClient
from millstream.envpool.actors.generation import Sampling
from millstream.shared.config import Config, dump_config, load_config
from millstream.shared.models.tiny import build_tiny_model
from millstream.shared.process.runtime import free_port
from millstream.shared.wire.keys import load_keys
from millstream.shared.wire.transport import open_channel

__all__ = ["main"]

#: Transport errors retried per HTTP request, as the official OpenAI client does by default.
HTTP_RETRIES = 2
THREADS_KEPT = 12  # the busiest threads kept per sample in `threads_ms_per_ktok`


class Load:
    """One load command: the shape and sizes every system gets."""

    def __init__(self, shape: str, concurrency: int, ns: argparse.Namespace, vocab: int) -> None:
        self.shape, self.concurrency, self.vocab = shape, concurrency, vocab
        self.waves, self.seconds = ns.waves, ns.seconds
        self.prompt_len, self.output_len = ns.prompt_len, ns.output_len

    def command(self) -> dict[str, Any]:
        return {
            "shape": self.shape,
            "concurrency": self.concurrency,
            "waves": self.waves,
            "seconds": self.seconds,
            "prompt_len": self.prompt_len,
            "output_len": self.output_len,
        }


# --- the three systems ------------------------------------------------------------------------


class OneAwake:
    """Keeps every engine but the measured one stopped (SIGSTOP of its process group).

    An idle vLLM engine is not idle: its worker and engine core spin (`sched_yield`) for a second
    after their last step, taking cores from the measured engine's OpenMP threads. Without this,
    samples of one system varied 1.5x and a system run after another inherited its spin.
    `settle_s` lets the measured engine's own spinners see the clock has moved and go idle.
    """

    def __init__(self, groups: dict[str, int], settle_s: float = 0.5) -> None:
        self.groups, self.settle_s = groups, settle_s

    def only(self, name: str) -> None:
        for other, group in self.groups.items():
            if other != name:
                os.killpg(group, signal.SIGSTOP)
        os.killpg(self.groups[name], signal.SIGCONT)
        time.sleep(self.settle_s)

    def wake_all(self) -> None:
        for group in self.groups.values():
            with suppress(ProcessLookupError):
                os.killpg(group, signal.SIGCONT)

    def measuring(self, name: str, system: Any) -> Any:
        def alone() -> dict[str, float]:
            self.only(name)
            return dict(system())

        return alone


def with_cpu(system: Any, roots: dict[str, int]) -> Any:
    """`system` with the CPU it used per thousand tokens, how many cores were busy, and where.

    `threads_ms_per_ktok` splits that CPU by thread ("ROOT:process/thread", ROOT one of
    `roots`, "bench" this process's own threads, the client's), the busiest first, so a sample
    says which thread of which process pays for the hop, not only that something does;
    `threads_wait_ms_per_ktok` is the time the same threads waited runnable for a core."""

    def measured() -> dict[str, Any]:
        before, cpu_before = tree_cpu_s(os.getpid()), labelled_threads(roots, thread_cpu_s)
        wait_before = labelled_threads(roots, thread_wait_s)
        result = system()
        cpu = tree_cpu_s(os.getpid()) - before
        tokens = max(result["tokens"], 1)
        used = {k: v - cpu_before.get(k, 0.0) for k, v in labelled_threads(roots, thread_cpu_s).items()}
        waited = {k: v - wait_before.get(k, 0.0) for k, v in labelled_threads(roots, thread_wait_s).items()}
        busiest = sorted((k for k in used if used[k] > 0), key=used.__getitem__, reverse=True)[:THREADS_KEPT]
        return {
            **result,
            "cpu_ms_per_ktok": 1e6 * cpu / tokens,
            "busy_cores": cpu / result["wall_s"],
            "threads_ms_per_ktok": {k: round(1e6 * used[k] / tokens, 1) for k in busiest},
            "threads_wait_ms_per_ktok": {k: round(1e6 * waited.get(k, 0.0) / tokens, 1) for k in busiest},
        }

    return measured


def through_millstream(cfg: Config, load: Load) -> dict[str, float]:
    async def main() -> dict[str, float]:
        keys = load_keys(cfg, "envpool")
        channel = open_channel("dealer", cfg.actor.address, bind=False, cfg=cfg.transport, keys=keys)
        client = ActorClient(channel, "bench")
        n = load.output_len

        async def one(index: int) -> tuple[int, float | None]:
            gen = await client.generate_once(
                prompt_ids(index, load.prompt_len, load.vocab),
                Sampling(max_tokens=n, timeout_s=600, ignore_eos=True, min_tokens=n),
                seed=None,
            )
            return len(gen.token_ids), gen.first_token_s

        async with anyio.create_task_group() as tg:
            tg.start_soon(channel.run)
            tg.start_soon(client.run)
            result = await run_load(one, load.shape, load.concurrency, load.waves, load.seconds)
            tg.cancel_scope.cancel()
        return result

    return anyio.run(main, backend="trio")


def through_asyncllm(engine: subprocess.Popen, load: Load) -> dict[str, float]:
    assert engine.stdin is not None and engine.stdout is not None
    engine.stdin.write(json.dumps(load.command()) + "\n")
    engine.stdin.flush()
    return dict(json.loads(read_json_line(engine.stdout, engine)))


def through_vllm_serve(url: str, model: str, load: Load) -> dict[str, float]:
    async def main() -> dict[str, float]:
        limits = httpx.Limits(
            max_connections=load.concurrency + 8, max_keepalive_connections=load.concurrency + 8
        )
        async with httpx.AsyncClient(base_url=url, limits=limits, timeout=600) as http:

            async def one(index: int) -> tuple[int, float | None]:
                body = {
                    "model": model,
                    "prompt": prompt_ids(index, load.prompt_len, load.vocab),
                    "max_tokens": load.output_len,
                    "min_tokens": load.output_len,
                    "ignore_eos": True,
                    "temperature": 1.0,
                    "logprobs": 0,
                }
                for attempt in range(HTTP_RETRIES + 1):
                    try:
                        response = await http.post("/v1/completions", json=body)
                        break
                    except httpx.TransportError:  # a pooled connection the server closed
                        if attempt == HTTP_RETRIES:
                            raise
                        retried[0] += 1
                response.raise_for_status()
                # Not streamed (one response per request, as peers call it): no first token time.
                return int(response.json()["usage"]["completion_tokens"]), None

            retried = [0]
            result = await run_load(one, load.shape, load.concurrency, load.waves, load.seconds)
            return {**result, "retries": retried[0]}

    return anyio.run(main, backend="asyncio")


# --- the systems ------------------------------------------------------------------------------

OPTIONAL_SYSTEMS = ("millstream", "vllm-serve", "asyncllm-again")
DEFAULT_SYSTEMS = ("millstream", "vllm-serve")


def systems_arg(text: str) -> tuple[str, ...]:
    """`--systems`: names checked before any engine starts."""
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in OPTIONAL_SYSTEMS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown systems {unknown}: choose from {', '.join(OPTIONAL_SYSTEMS)}"
        )
    return names


def start_systems(
    stack: ExitStack, cfg: Config, work: Path, names: tuple[str, ...], model: str, backwards: bool
) -> tuple[dict[str, Any], dict[str, int]]:
    """Start asyncllm and `names`, one at a time (actor, AsyncLLM, vllm serve, or `backwards`);
    returns each one's measurement (a function of the load), reference first, and each one's
    root process id."""
    config_path = work / "config.toml"
    started: dict[str, tuple[subprocess.Popen, Any]] = {}

    def actor() -> None:
        started["millstream"] = (start_actor(stack, cfg, config_path, work), partial(through_millstream, cfg))

    def asyncllm(name: str) -> None:
        engine = start_asyncllm(stack, cfg, config_path, work, name)
        started[name] = (engine, partial(through_asyncllm, engine))

    def serve() -> None:
        server, url = start_vllm_serve(stack, cfg, work)
        started["vllm-serve"] = (server, partial(through_vllm_serve, url, model))

    steps: dict[str, Callable[[], None]] = {
        "millstream": actor,
        "asyncllm": partial(asyncllm, "asyncllm"),
        "asyncllm-again": partial(asyncllm, "asyncllm-again"),
        "vllm-serve": serve,
    }
    wanted = [name for name in steps if name == "asyncllm" or name in names]
    for name in reversed(wanted) if backwards else wanted:
        steps[name]()
    lower_baseline_cores(cfg, [proc for name, (proc, _) in started.items() if name != "millstream"])
    order = ["asyncllm", *(n for n in OPTIONAL_SYSTEMS if n in names)]
    return {n: started[n][1] for n in order}, {n: started[n][0].pid for n in order}


def say_ratios(title: str, outcome: Outcome) -> None:
    paired = outcome.paired_ratios()
    ratios = ", ".join(
        f"{s}/asyncllm {r:.3f} (pairs {min(paired[s]):.2f}-{max(paired[s]):.2f})"
        for s, r in outcome.ratios().items()
        if s != "asyncllm"
    )
    print(f"{title}: {ratios}", flush=True)


def print_table(rows: list[tuple[str, int, Any]]) -> None:
    """The run as a Markdown table: tokens/s, ratios (of medians; paired per round in brackets),
    CPU per 1,000 tokens and the first token's p50, system by system."""
    names = list(rows[0][2].samples) if rows else []
    print(
        f"\n| shape | concurrency | {' / '.join(names)} tok/s | ratio to asyncllm (pairs median, range) "
        "| CPU ms per 1k tokens | first token p50 ms |"
    )
    print("|---|---|---|---|---|---|")
    for shape, concurrency, outcome in rows:
        summary = outcome.summary()
        systems, paired, reference = summary["systems"], summary["paired_ratios"], summary["reference"]
        rates = " / ".join(f"{outcome.median(s):,.0f}" for s in names)
        ratios = "; ".join(
            f"{s} {r:.3f} ({paired[s]['median']:.2f}, {paired[s]['min']:.2f}-{paired[s]['max']:.2f})"
            for s, r in summary["ratios"].items()
            if s != reference
        )
        cpu = " / ".join(f"{systems[s]['cpu_ms_per_ktok']['median']:,.0f}" for s in names)
        first = " / ".join(
            f"{systems[s]['first_token_ms_p50']['median']:.1f}" if "first_token_ms_p50" in systems[s] else "-"
            for s in names
        )
        if {"millstream", "vllm-serve"} <= set(names):
            hop = outcome.median("millstream") / outcome.median("vllm-serve")
            ratios += f"; millstream / vllm-serve {hop:.3f}"
        print(f"| {shape} | {concurrency} | {rates} | {ratios} | {cpu} | {first} |")


# --- the run ----------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m millstream.bench.overhead", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--quick", action="store_true", help="concurrency 64 only, 2 waves / 3 s loops")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--concurrency", default="64,256")
    p.add_argument("--shapes", default="waves,closed")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--waves", type=int, default=8)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument(
        "--systems",
        type=systems_arg,
        default=DEFAULT_SYSTEMS,
        help=f"compared with asyncllm, which always runs: any of {', '.join(OPTIONAL_SYSTEMS)} "
        "(asyncllm-again: a second AsyncLLM, the A/A control)",
    )
    p.add_argument(
        "--instances",
        type=int,
        default=1,
        help="start every engine afresh this many times, --rounds each, the samples pooled "
        "(so that no ratio rests on one start of each engine)",
    )
    ns = p.parse_args(argv)
    if ns.instances < 1 or ns.rounds < 1:
        p.error("--instances and --rounds must be at least 1")
    # A SIGTERM unwinds like an exception, so the engines are woken and stopped, not left
    # SIGSTOPped as orphans.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    if ns.quick:
        ns.waves, ns.seconds, ns.concurrency = 2, 3.0, "64"
    levels = [int(c) for c in ns.concurrency.split(",")]
    with scratch("millstream-overhead-") as work:
        model = build_tiny_model(work / "tiny", seed=0)
        overrides = [
            f"model.path={model}",
            f"actor.address=tcp://127.0.0.1:{free_port()}",
            f"actor.max_num_seqs={max(levels)}",
            f"transport.keys_dir={work / 'keys'}",
            # Both sides on every core, as AsyncLLM alone runs: the comparison is of the engine
            # behind millstream, not of a core split (shared/process/cpus.py).
            "actor.cpus=all",
        ]
        cfg = load_config(None, overrides)
        config_path = work / "config.toml"
        config_path.write_text(dump_config(cfg))
        vocab = json.loads((model / "config.json").read_text())["vocab_size"]
        folder = results_dir()  # once: a run that passes midnight keeps one folder
        per_load: dict[tuple[str, int], list[Outcome]] = {}
        for instance in range(ns.instances):
            with ExitStack() as stack:
                runs, roots = start_systems(
                    stack, cfg, work, ns.systems, str(model), backwards=instance % 2 == 1
                )
                awake = OneAwake(roots)
                stack.callback(awake.wake_all)
                for shape in ns.shapes.split(","):
                    for concurrency in levels:
                        load = Load(shape, concurrency, ns, vocab)
                        outcome = compare(
                            {
                                n: awake.measuring(n, with_cpu(partial(run, load), roots))
                                for n, run in runs.items()
                            },
                            rounds=ns.rounds,
                            metric="tokens_s",
                            warmup=True,
                            settings={
                                **load.command(),
                                "model": "tiny Qwen2, float32, CPU",
                                "kv_bytes": cfg.actor.kv_cache_bytes,
                            },
                        )
                        name = f"overhead-{shape}-c{concurrency}" + ("-quick" if ns.quick else "")
                        say_ratios(f"{name}, engines {instance + 1}/{ns.instances}", outcome)
                        outcomes = per_load.setdefault((shape, concurrency), [])
                        outcomes.append(outcome)
                        # Written as it grows: a run cut short keeps what it measured.
                        extra = (
                            {"per_instance": [o.summary() for o in outcomes]} if ns.instances > 1 else None
                        )
                        write_outcome(pooled(outcomes), folder, name, extra)
    rows = [(shape, concurrency, pooled(outcomes)) for (shape, concurrency), outcomes in per_load.items()]
    for shape, concurrency, outcome in rows:
        say_ratios(f"overhead-{shape}-c{concurrency}, all {ns.instances} engine starts", outcome)
    print_table(rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
