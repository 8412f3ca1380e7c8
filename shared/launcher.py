"""`millstream run`: start actor, learner and envpool workers from one config, and supervise them.

    millstream run [config.toml] [dotted.key=value ...]

What it does:
1. resolves the config (file + overrides), builds the tiny model if `model.path` is empty, picks
   free ports for every address left at port 0, and writes the run directory:
   `config.toml` (the resolved config every role reads), `logs/<role>.log`, and later
   `metrics.jsonl`, `trajectories.jsonl`, `summary.json`, `final/` (from the learner);
2. starts the roles as separate processes (`python -m millstream.actor|learner|envpool`), each in its own
   process group so that stopping one also stops its children (vLLM spawns several);
3. shows the learner's progress lines, and watches: the run ends when the learner exits; any
   role dying first is an error that stops the others and names the role and its log;
4. on Ctrl-C or SIGTERM, stops every process (SIGTERM, then SIGKILL after a grace period).

The launcher imports no role package: roles are processes, joined only by the addresses in the
config, so the same roles can be placed on other hosts by a cluster manager instead.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from datetime import datetime
from pathlib import Path

import orjson

from .config import Config, dump_config, load_config
from .runtime import free_port

__all__ = ["launch", "Supervisor"]


def _with_port(address: str) -> str:
    if address.startswith("tcp://") and address.endswith(":0"):
        host = address[len("tcp://"):-2]
        return f"tcp://{host}:{free_port(host)}"
    return address


def prepare_run(cfg_path: str | None, overrides: list[str]) -> tuple[Config, Path]:
    """Resolve the config, make the run directory and write `config.toml` into it."""
    cfg = load_config(cfg_path, overrides)
    run_dir = Path(cfg.run.dir) if cfg.run.dir else Path(cfg.run.root) / (
        f"{cfg.run.name}-{datetime.now().strftime('%Y%m%d-%H%M%S')}")
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "logs").mkdir(exist_ok=True)
    from .runtime import resolve_model_dir

    model_dir = resolve_model_dir(cfg)
    resolved = [
        f"run.dir={_q(str(run_dir.resolve()))}",
        f"model.path={_q(model_dir)}",
        f"learner.experience_address={_q(_with_port(cfg.learner.experience_address))}",
        f"learner.version_address={_q(_with_port(cfg.learner.version_address))}",
    ]
    if not cfg.actor.connect:
        resolved.append(f"actor.address={_q(_with_port(cfg.actor.address))}")
    cfg = load_config(cfg_path, overrides + resolved)
    (run_dir / "config.toml").write_text(dump_config(cfg))
    return cfg, run_dir


def _q(text: str) -> str:
    return orjson.dumps(text).decode()


class Supervisor:
    """Child processes of one run, each in its own process group."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.procs: dict[str, subprocess.Popen] = {}
        self.logs: dict[str, Path] = {}

    def start(self, name: str, module: str, args: list[str], *, pipe_stdout: bool = False) -> None:
        log = self.run_dir / "logs" / f"{name}.log"
        self.logs[name] = log
        out = log.open("ab")
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.procs[name] = subprocess.Popen(
            [sys.executable, "-m", module, *args],
            stdout=subprocess.PIPE if pipe_stdout else out, stderr=out, stdin=subprocess.DEVNULL,
            env=env, start_new_session=True)
        (self.run_dir / f"{name}.pid").write_text(str(self.procs[name].pid))

    def exited(self) -> dict[str, int]:
        return {n: p.returncode for n, p in self.procs.items() if p.poll() is not None}

    def stop(self, grace_s: float = 15.0) -> None:
        for proc in self.procs.values():
            _signal_group(proc, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            _signal_group(proc, signal.SIGKILL)  # children of a dead parent, or a stuck one
            proc.wait()

    def tail(self, name: str, lines: int = 15) -> str:
        try:
            return "\n".join(self.logs[name].read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def launch(cfg_path: str | None, overrides: list[str], *, out=sys.stdout) -> int:
    """Run a whole job; returns the process exit code (0: finished and accounting holds)."""
    cfg, run_dir = prepare_run(cfg_path, overrides)
    config = ["--config", str(run_dir / "config.toml")]
    sup = Supervisor(run_dir)
    print(f"millstream run: {run_dir}", file=out, flush=True)
    stop = threading.Event()

    def on_signal(signum, frame):
        stop.set()

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        if not cfg.actor.connect:
            sup.start("actor", "millstream.actor", config)
        if cfg.learner.ranks > 1:  # data-parallel learner: torchrun starts the ranks
            sup.start("learner", "torch.distributed.run",
                      ["--nproc_per_node", str(cfg.learner.ranks), "--master_addr", "127.0.0.1",
                       "--master_port", str(free_port()), "-m", "millstream.learner", *config],
                      pipe_stdout=True)
        else:
            sup.start("learner", "millstream.learner", config, pipe_stdout=True)
        for i in range(cfg.envpool.workers):
            sup.start(f"envpool-{i}", "millstream.envpool", [*config, "--worker-index", str(i)])
        relay = threading.Thread(target=_relay, args=(sup.procs["learner"].stdout, out), daemon=True)
        relay.start()
        code = _watch(sup, cfg, stop, out)
        relay.join(timeout=5)
    finally:
        sup.stop()
        for sig, handler in old.items():
            signal.signal(sig, handler)
    if code == 0:
        _print_summary(run_dir, out)
    return code


def _relay(stream, out) -> None:
    for line in iter(stream.readline, b""):
        out.write(line.decode(errors="replace"))
        out.flush()


def _watch(sup: Supervisor, cfg: Config, stop: threading.Event, out) -> int:
    while not stop.wait(0.5):
        exited = sup.exited()
        if "learner" in exited:
            code = exited["learner"]
            if code != 0:
                print(f"learner failed (exit {code}); its log {sup.logs['learner']} ends:\n"
                      f"{sup.tail('learner')}", file=out, flush=True)
                return 1
            # Workers exit by themselves after the learner's final announcement.
            deadline = time.monotonic() + 60
            workers = [n for n in sup.procs if n.startswith("envpool")]
            while time.monotonic() < deadline and not all(n in sup.exited() for n in workers):
                time.sleep(0.2)
            return 0
        for name, code in exited.items():
            if name.startswith("envpool") and code == 0:
                continue  # a worker may finish a moment before the learner does
            print(f"{name} exited early (exit {code}); stopping the run. Its log "
                  f"{sup.logs[name]} ends:\n{sup.tail(name)}", file=out, flush=True)
            return 1
    print("interrupted: stopping every process", file=out, flush=True)
    return 130


def _print_summary(run_dir: Path, out) -> None:
    path = run_dir / "summary.json"
    if not path.exists():
        return
    summary = orjson.loads(path.read_bytes())
    print(f"episodes: started {summary['episodes_started']}, trained {summary['episodes_trained']}, "
          f"dropped {summary['episodes_dropped']}, failed {summary['episodes_failed']} "
          f"(accounting {'ok' if summary['accounting_ok'] else 'BROKEN'})", file=out)
    print(f"final weights: {summary['final_weights']}; metrics: {run_dir / 'metrics.jsonl'}",
          file=out, flush=True)
