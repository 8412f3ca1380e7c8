"""Starting and stopping the engines the overhead benchmark compares, one at a time.

Every engine gets the actor's allocator and OpenMP settings (`engine_environment`), its own
process group in the benchmark's session (bench/kit/spawn.py: `OneAwake` stops a group whole,
and autogroup starved the client when each engine led a session of its own), and its EngineCore
lowered as the actor lowers its own. An engine that exits or does not answer in time fails the
run with its name, and every one started is stopped with the run (`ExitStack`).

`asyncllm` can be started twice: the second copy (`asyncllm-again`) is the A/A control, the
same engine and the same process layout as the reference, so the spread of its ratio to the
reference is what the machine alone does to two identical engines.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import IO, Any

from millstream.bench.kit.spawn import spawn, stop
from millstream.shared.config import Config
from millstream.shared.process.enginecore import engine_core_nice, lower_engine_cores
from millstream.shared.process.runtime import engine_environment, free_port

__all__ = ["read_json_line", "start_actor", "start_asyncllm", "start_vllm_serve", "lower_baseline_cores"]


def read_json_line(stream: IO[str], proc: subprocess.Popen, timeout_s: float = 900) -> str:
    """The next line of `proc`'s stdout that is a JSON object (vLLM logs to it as well)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = stream.readline()
        if line.startswith("{"):
            return line
        if not line and proc.poll() is not None:
            raise RuntimeError(f"the AsyncLLM process exited with {proc.returncode}")
    raise TimeoutError("no answer from the AsyncLLM process")


def _spawn(stack: ExitStack, cfg: Config, command: list[str], log: Path, **kwargs: Any) -> subprocess.Popen:
    """One engine's process, with the actor's allocator and OpenMP wait policy: the hop compared.
    Its log is appended to, so every start of it (`--instances`) is kept."""
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND="nobind", **engine_environment(cfg))
    with log.open("ab") as out:  # the child holds its own copy of the descriptor
        proc = spawn(command, stderr=out, env=env, **kwargs)
    stack.callback(stop, proc)  # the whole group gone before the next start
    return proc


def _wait(check: Callable[[], bool], proc: subprocess.Popen, what: str, timeout_s: float = 900) -> None:
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


def start_actor(stack: ExitStack, cfg: Config, config_path: Path, work: Path) -> subprocess.Popen:
    """millstream's actor (`python -m millstream.actor`), which lowers its own EngineCore."""
    ready = work / "ready"
    ready.unlink(missing_ok=True)  # an actor started before in this folder left it
    command = [
        sys.executable,
        "-m",
        "millstream.actor",
        "--config",
        str(config_path),
        "--ready-file",
        str(ready),
    ]
    actor = _spawn(stack, cfg, command, work / "actor.log", stdout=subprocess.DEVNULL)
    _wait(ready.exists, actor, "the actor")
    print("actor ready", flush=True)
    return actor


def start_asyncllm(
    stack: ExitStack, cfg: Config, config_path: Path, work: Path, name: str
) -> subprocess.Popen:
    """vLLM's AsyncLLM in a process of its own (bench/baselines/overhead_engine.py)."""
    command = [sys.executable, "-m", "millstream.bench.baselines.overhead_engine", str(config_path)]
    engine = _spawn(
        stack, cfg, command, work / f"{name}.log", stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert engine.stdout is not None
    read_json_line(engine.stdout, engine)
    print(f"{name} ready", flush=True)
    return engine


def start_vllm_serve(stack: ExitStack, cfg: Config, work: Path) -> tuple[subprocess.Popen, str]:
    """vLLM's OpenAI server with the actor's engine settings; returns it and its URL."""
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
    server = _spawn(stack, cfg, serve, work / "vllm-serve.log", stdout=subprocess.DEVNULL)
    _wait(lambda: _healthy(url), server, "vllm serve")
    print("vllm serve ready", flush=True)
    return server, url


def lower_baseline_cores(cfg: Config, procs: list[subprocess.Popen]) -> None:
    """Lower the baselines' EngineCores as the actor lowers its own; an engine whose EngineCore
    is not found would run unlowered against a lowered one, so that fails the run."""
    nice = engine_core_nice(cfg)
    if nice is not None and not all(lower_engine_cores(nice, proc.pid) for proc in procs):
        raise RuntimeError("found no EngineCore of a baseline engine to lower: unfair")
