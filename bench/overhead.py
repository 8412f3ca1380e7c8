"""millstream's overhead against the engine alone: generated tokens/s, three ways, one model.

    python -m millstream.bench.overhead [--quick] [--rounds 3] [--concurrency 64,256]

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
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import ExitStack, suppress
from functools import partial
from pathlib import Path
from typing import IO, Any

import anyio
import httpx

from millstream.bench.baselines.overhead_load import prompt_ids, run_load
from millstream.bench.kit.procstat import labelled_threads, thread_cpu_s, thread_wait_s, tree_cpu_s
from millstream.bench.kit.rounds import compare, results_dir, write_outcome
from millstream.bench.kit.spawn import spawn
from millstream.envpool.actors.client import ActorClient
from millstream.envpool.actors.generation import Sampling
from millstream.shared.config import Config, dump_config, load_config
from millstream.shared.models.tiny import build_tiny_model
from millstream.shared.process.enginecore import engine_core_nice, lower_engine_cores
from millstream.shared.process.runtime import engine_environment, free_port
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
    return dict(json.loads(_read_json_line(engine.stdout, engine)))


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


# --- starting the engines ---------------------------------------------------------------------


def _read_json_line(stream: IO[str], proc: subprocess.Popen, timeout_s: float = 900) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = stream.readline()
        if line.startswith("{"):
            return line
        if not line and proc.poll() is not None:
            raise RuntimeError(f"the AsyncLLM process exited with {proc.returncode}")
    raise TimeoutError("no answer from the AsyncLLM process")


def _spawn(
    stack: ExitStack, command: list[str], log: Path, engine_env: dict[str, str], **kwargs: Any
) -> subprocess.Popen:
    """One engine's process, with the actor's allocator and OpenMP wait policy: the hop compared.
    A group of its own (OneAwake stops it whole) in this session, as the launcher's roles
    (bench/kit/spawn.py: autogroup starved the client otherwise)."""
    out, env = log.open("wb"), dict(os.environ, VLLM_CPU_OMP_THREADS_BIND="nobind", **engine_env)
    proc = spawn(command, stderr=out, env=env, **kwargs)
    stack.callback(_stop, proc)
    return proc


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGCONT)  # a stopped process would hold SIGTERM pending
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def _wait(check: Any, proc: subprocess.Popen, what: str, timeout_s: float = 900) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode} before it was ready")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} was not ready within {timeout_s}s")
        time.sleep(0.5)


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def start_engines(
    stack: ExitStack, cfg: Config, config_path: Path, work: Path
) -> tuple[subprocess.Popen, subprocess.Popen, str, subprocess.Popen]:
    engine_env = engine_environment(cfg)  # as the actor's own
    actor = _spawn(
        stack,
        [
            sys.executable,
            "-m",
            "millstream.actor",
            "--config",
            str(config_path),
            "--ready-file",
            str(work / "ready"),
        ],
        work / "actor.log",
        engine_env,
        stdout=subprocess.DEVNULL,
    )
    _wait(lambda: (work / "ready").exists(), actor, "the actor")
    print("actor ready", flush=True)
    engine = _spawn(
        stack,
        [sys.executable, "-m", "millstream.bench.baselines.overhead_engine", str(config_path)],
        work / "asyncllm.log",
        engine_env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert engine.stdout is not None
    _read_json_line(engine.stdout, engine)
    print("AsyncLLM ready", flush=True)
    port, a = free_port(), cfg.actor
    serve = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        *("--model", cfg.model.path, "--dtype", cfg.model.dtype, "--seed", str(cfg.run.seed)),
        *("--host", "127.0.0.1", "--port", str(port), "--max-model-len", str(a.max_model_len)),
        *("--max-num-seqs", str(a.max_num_seqs), "--kv-cache-memory-bytes", str(a.kv_cache_bytes)),
        *("--no-enable-chunked-prefill", "--max-num-batched-tokens", str(max(a.max_model_len, 8192))),
        "--enforce-eager",
        "--disable-uvicorn-access-log",
    ]
    url = f"http://127.0.0.1:{port}"
    server = _spawn(stack, serve, work / "vllm-serve.log", engine_env, stdout=subprocess.DEVNULL)
    _wait(lambda: _healthy(url), server, "vllm serve")
    print("vllm serve ready", flush=True)
    nice = engine_core_nice(cfg)  # as the actor lowers its own EngineCore
    if nice is not None and not all(lower_engine_cores(nice, proc.pid) for proc in (engine, server)):
        raise RuntimeError("found no EngineCore of AsyncLLM or vllm serve to lower: unfair")
    return actor, engine, url, server


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
    ns = p.parse_args(argv)
    # A SIGTERM unwinds like an exception, so the engines are woken and stopped, not left
    # SIGSTOPped as orphans.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    if ns.quick:
        ns.waves, ns.seconds, ns.concurrency = 2, 3.0, "64"
    levels = [int(c) for c in ns.concurrency.split(",")]
    work = Path(tempfile.mkdtemp(prefix="millstream-overhead-"))
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
    rows = []
    with ExitStack() as stack:
        actor, engine, url, server = start_engines(stack, cfg, config_path, work)
        roots = {"asyncllm": engine.pid, "millstream": actor.pid, "vllm-serve": server.pid}
        awake = OneAwake(roots)
        stack.callback(awake.wake_all)
        for shape in ns.shapes.split(","):
            for concurrency in levels:
                load = Load(shape, concurrency, ns, vocab)
                outcome = compare(
                    {
                        name: awake.measuring(name, with_cpu(system, roots))
                        for name, system in (
                            ("asyncllm", partial(through_asyncllm, engine, load)),
                            ("millstream", partial(through_millstream, cfg, load)),
                            ("vllm-serve", partial(through_vllm_serve, url, str(model), load)),
                        )
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
                write_outcome(outcome, results_dir(), name)
                ratios = outcome.ratios()
                rows.append((shape, concurrency, outcome, ratios))
                m, v = ratios["millstream"], ratios["vllm-serve"]
                print(f"{name}: millstream/asyncllm {m:.3f}, vllm-serve/asyncllm {v:.3f}")
    print(
        "\n| shape | concurrency | asyncllm tok/s | millstream tok/s | vllm serve tok/s "
        "| millstream / asyncllm | millstream / vllm serve | CPU ms per 1k tokens (a / m / v) "
        "| first token p50 ms (a / m) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for shape, concurrency, outcome, _ in rows:
        names = ("asyncllm", "millstream", "vllm-serve")
        a, m, v = (outcome.median(s) for s in names)
        systems = outcome.summary()["systems"]
        cpu = " / ".join(f"{systems[s]['cpu_ms_per_ktok']['median']:,.0f}" for s in names)
        first = " / ".join(
            f"{systems[s]['first_token_ms_p50']['median']:.1f}" if "first_token_ms_p50" in systems[s] else "-"
            for s in names[:2]
        )
        print(
            f"| {shape} | {concurrency} | {a:,.0f} | {m:,.0f} | {v:,.0f} | {m / a:.3f} | {m / v:.3f} "
            f"| {cpu} | {first} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
