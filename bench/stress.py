"""`millstream stress`: will my environment hold N concurrent episodes, and what breaks?

    millstream stress --env echo --episodes 20000 --concurrency 10000 --actor synthetic
    millstream stress --env frozenlake --episodes 2000 --concurrency 500 \\
        --actor tcp://gpu-host:5555 --faults crash=0.01,hang=0.01,garbage=0.05

What runs: the real envpool workers (`python -m millstream.envpool`, as `millstream run` starts them) against
an actor, either a synthetic actor started here (actor/synthetic.py: a timing model, no GPU) or a
running actor at ADDRESS (a vLLM actor of a real run works unchanged). This process stands in for
the learner: it announces a policy version whose admission limit lets every group start as soon as
a worker has room (so `--concurrency` is the only bound), and counts what the workers push back.

Faults wrap the environment in `flaky` (envpool/envs/checks/flaky.py): `crash` raises in reset/step,
`hang` sleeps past `envpool.step_timeout_s` (5 s here unless `--set` says otherwise), `garbage`
replaces the model's reply by unparseable bytes (the environment answers with its format penalty).

While it runs, a progress line per second; at the end a table (episodes, turns/s, p50/p95/p99
turn latency, memory per live episode, failures by cause, lost), and in `--out`: `report.json`,
`stress.png` (throughput, latency and live episodes over time), the resolved config, every
worker's statistics JSONL and every process's log (`logs/`). The exit status is 1 if anything was lost.

"Lost" means an episode a worker started and never reported (neither a trajectory nor a failure
with a cause); it must be 0. Episodes the run never started (time ran out) are counted apart.
"""

from __future__ import annotations

import argparse
import atexit
import functools
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import zmq

from millstream.bench.kit.procstat import CpuMeter
from millstream.bench.kit.scratch import scratch
from millstream.bench.kit.stress_report import (
    ResultWindow,
    StatsFollower,
    build_report,
    format_table,
    plot_report,
    write_json,
)
from millstream.envpool.envs import make_env
from millstream.shared.config import ConfigError, dump_config, load_config, toml_value
from millstream.shared.process.runtime import free_port, raise_fd_limit, resolve_model_dir
from millstream.shared.process.supervisor import Supervisor
from millstream.shared.store.trajstore import (
    STORE_FILE,
    episode_from_failure,
    episode_from_trajectory,
)
from millstream.shared.store.writer import StoreWriter
from millstream.shared.wire import Codec, EpisodeFailed, PolicyVersion, PoolDone, Trajectory
from millstream.shared.wire.keys import load_keys, secure

__all__ = ["main", "parse_faults", "run_stress", "stress_once", "stress_parser"]

FAULTS = ("crash", "hang", "garbage")


def parse_faults(text: str) -> dict[str, float]:
    """`crash=0.01,hang=0.01,garbage=0.05` -> {"crash": 0.01, ...}; names and values checked."""
    faults: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = part.partition("=")
        if not sep or name not in FAULTS:
            raise ValueError(f"--faults: {part!r} is not NAME=P with NAME one of {', '.join(FAULTS)}")
        try:
            p = float(value)
        except ValueError:
            raise ValueError(f"--faults: {name}={value!r} is not a number") from None
        if not 0 <= p <= 1:
            raise ValueError(f"--faults: {name}={p} is not a probability in [0, 1]")
        faults[name] = p
    if sum(faults.values()) > 1 + 1e-9:
        raise ValueError(f"--faults: probabilities sum to {sum(faults.values())} > 1")
    return faults


def stress_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="millstream stress",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,  # --help shows each default
    )
    p.add_argument("--env", default="echo", help="environment name (registry or entry point)")
    p.add_argument("--episodes", type=int, default=2000, help="episodes to run in total")
    p.add_argument("--concurrency", type=int, default=500, help="live episodes at most, all workers")
    p.add_argument("--actor", default="synthetic", help="'synthetic' (started here) or an address")
    p.add_argument("--faults", default="", help="crash=P,hang=P,garbage=P (default: %(default)r, no faults)")
    p.add_argument("--workers", type=int, default=1, help="envpool worker processes")
    p.add_argument("--group-size", type=int, default=8, help="episodes per group (same seed)")
    p.add_argument("--out", default="", help="output folder (default: %(default)r, runs/stress-<env>-<time>)")
    p.add_argument("--timeout-s", type=float, default=3600, help="give up (and report) after this")
    p.add_argument(
        "--config",
        default=None,
        help="TOML config to start from (default: %(default)s, the embedded defaults)",
    )
    p.add_argument(
        "--store",
        action="store_true",
        help="write every episode to <out>/store.sqlite as the learner does (shared/store/trajstore.py)",
    )
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="dotted config override, repeatable (e.g. actor.max_num_seqs=512)",
    )
    return p


def stress_config(ns: argparse.Namespace, out: Path) -> tuple:
    """The resolved config every process of the stress run reads, and the faults."""
    faults = parse_faults(ns.faults)
    if ns.episodes < 1 or ns.concurrency < 1 or ns.workers < 1 or ns.group_size < 1:
        raise ValueError("--episodes, --concurrency, --workers and --group-size must be >= 1")
    if ns.episodes % ns.group_size:
        raise ValueError(f"--episodes {ns.episodes} is not a multiple of --group-size {ns.group_size}")
    per_worker = math.ceil(ns.concurrency / ns.workers)
    if per_worker < ns.group_size:
        raise ValueError(
            f"--concurrency {ns.concurrency} over {ns.workers} workers leaves "
            f"{per_worker} slots each, fewer than one group of {ns.group_size}"
        )
    defaults = [
        f"envpool.max_concurrent_episodes={per_worker}",
        f"envpool.workers={ns.workers}",
        "envpool.step_timeout_s=5",
        "envpool.stats_every_s=1",
        "envpool.max_consecutive_actor_failures=1000000000",
        f"train.group_size={ns.group_size}",
        f"run.dir={out}",
    ]
    cfg = load_config(ns.config, defaults + ns.overrides)
    env, env_args = ns.env, dict(cfg.envpool.env_args)
    if faults:
        env_args = {
            "inner": ns.env,
            "inner_args": env_args,
            "hang_s": 3600.0,
            "crash_prob": faults.get("crash", 0.0),
            "hang_prob": faults.get("hang", 0.0),
            "garbage_prob": faults.get("garbage", 0.0),
            "fault_seed": cfg.run.seed,
        }
        env = "flaky"
    make_env(env, env_args)  # an unknown name or bad arguments: a clear error before anything starts
    exp, ver = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    actor = ns.actor if ns.actor != "synthetic" else f"tcp://127.0.0.1:{free_port()}"
    env_args_toml = toml_value(env_args)
    cfg = load_config(
        ns.config,
        defaults
        + ns.overrides
        + [
            f"envpool.env={env}",
            f"envpool.env_args={env_args_toml}",
            f"model.path={resolve_model_dir(cfg)}",
            f"actor.connect={actor}",
            f"actor.address={actor}",
            f"learner.experience_address={exp}",
            f"learner.version_address={ver}",
        ],
    )
    return cfg, faults


def _check(sup: Supervisor) -> None:
    """Raise, naming the process and the end of its log, if a child exited with an error."""
    for name, code in sup.exited().items():
        if code != 0:
            raise RuntimeError(f"{name} exited with {code}; its log ends:\n{sup.tail(name, 40)}")


def _wait_exit(sup: Supervisor, names: list[str], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    for name in names:
        try:
            sup.procs[name].wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass


def _wait_ready(ready: Path, sup: Supervisor, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready.exists():
        _check(sup)
        if time.monotonic() > deadline:
            raise TimeoutError(f"the synthetic actor wrote no {ready} in {timeout_s}s")
        time.sleep(0.1)


def run_stress(ns: argparse.Namespace) -> dict:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = Path(ns.out or f"runs/stress-{ns.env}-{stamp}").resolve()
    cfg, faults = stress_config(ns, out)  # bad input fails here, before anything is created
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.toml").write_text(dump_config(cfg))
    raise_fd_limit()
    groups = ns.episodes // ns.group_size
    (out / "logs").mkdir(exist_ok=True)
    sup = Supervisor(out)  # the launcher's: own process groups, logs in out/logs
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    pull, pub = ctx.socket(zmq.PULL), ctx.socket(zmq.PUB)
    pull.set_hwm(0)  # the stand-in learner must never make a worker's PUSH block
    keys = load_keys(cfg, "learner")  # <out>/keys unless transport.keys_dir says otherwise
    secure(pull, keys, bind=True)
    secure(pub, keys, bind=True)
    pull.bind(cfg.learner.experience_address)
    pub.bind(cfg.learner.version_address)
    codec = Codec()
    outcomes: Counter = Counter()
    turns = invalid = 0
    done: dict[str, PoolDone] = {}
    follower = StatsFollower(out)
    store = StoreWriter(out / STORE_FILE) if ns.store else None  # the learner's writer, same thread model
    window = ResultWindow()
    started = time.monotonic()
    try:
        if ns.actor == "synthetic":
            sup.start(
                "actor",
                "millstream.actor",
                [
                    "--config",
                    str(out / "config.toml"),
                    "--ready-file",
                    str(out / "actor.ready"),
                    "actor.kind=synthetic",
                ],
            )
            _wait_ready(out / "actor.ready", sup, 120)
        for i in range(ns.workers):
            sup.start(
                f"envpool-w{i}",
                "millstream.envpool",
                ["--config", str(out / "config.toml"), "--worker-index", str(i)],
            )
        roots = {name: proc.pid for name, proc in sup.procs.items()} | {"driver": os.getpid()}
        cpu = CpuMeter(roots, alone=frozenset({"driver"}))
        t0 = time.monotonic()
        final = False
        last_beat = last_line = 0.0
        tty = sys.stdout.isatty()
        while len(done) < ns.workers:
            now = time.monotonic()
            if now - last_beat >= 0.2:
                pub.send(codec.encode([PolicyVersion(0, groups, 0, final=final)]))
                last_beat = now
                _check(sup)
            if pull.poll(50):
                while True:
                    try:
                        frame = pull.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    for m in codec.decode(frame):
                        if isinstance(m, (Trajectory, EpisodeFailed)):
                            window.saw(m.num_turns if isinstance(m, Trajectory) else 0)
                        if isinstance(m, Trajectory):
                            outcomes["completed"] += 1
                            turns += m.num_turns
                            invalid += m.invalid_actions
                            if store is not None:
                                store.put(episode_from_trajectory(m, fate="trained", step=0))
                        elif isinstance(m, EpisodeFailed):
                            outcomes[str(m.cause)] += 1  # the cause's value: a JSON key
                            if store is not None:
                                store.put(episode_from_failure(m, step=0))
                        elif isinstance(m, PoolDone):
                            done[m.worker] = m
            accounted = sum(outcomes.values())
            timed_out = now - t0 > ns.timeout_s
            if turns and not cpu.started:
                cpu.start(turns)  # from the first finished episode, as the steady window
            if not final and (accounted >= ns.episodes or timed_out):
                final = True  # workers end what still runs as run_ended, then send PoolDone
                final_at = now
                cpu.stop(turns)
            if now - last_line >= 1.0:
                follower.poll()
                line = follower.progress_line(now - t0, accounted, ns.episodes, outcomes)
                print(("\r" + line + "\x1b[K") if tty else line, end="" if tty else "\n", flush=True)
                last_line = now
            if final and now - final_at > 120:
                break  # workers did not report PoolDone: report what we have
        wall = time.monotonic() - t0
        _wait_exit(sup, [f"envpool-w{i}" for i in range(ns.workers)], 30)
        follower.poll()
        if tty:
            print()
    finally:
        sup.stop(grace_s=5)
        pull.close(0)
        pub.close(0)
        if store is not None:
            store.close()
    report = build_report(
        args=vars(ns),
        faults=faults,
        wall_s=wall,
        setup_s=t0 - started,
        outcomes=outcomes,
        turns=turns,
        invalid_actions=invalid,
        pool_done=list(done.values()),
        follower=follower,
        episodes=ns.episodes,
    )
    report["steady"] = window.summary()
    report["cpu"] = {"s": cpu.cpu_s, "turns": cpu.work, "us_per_turn": cpu.per_unit_us()}
    if store is not None:
        report["store"] = {**store.statistics(), "bytes": (out / STORE_FILE).stat().st_size}
    write_json(report, out / "report.json")
    plot_report(
        follower,
        out / "stress.png",
        title=f"millstream stress: {ns.env}, {ns.episodes} "
        f"episodes, concurrency {ns.concurrency}, actor {ns.actor}",
    )
    print(format_table(report))
    print(f"report: {out / 'report.json'}  plot: {out / 'stress.png'}")
    return report


@functools.cache
def _shared_keys() -> Path:
    """The CURVE keys of every `stress_once` run in this process: a process serves one set of keys
    (shared/wire/keys.py), so benchmarks that run stress many times share one folder. Made on first
    use, not at import (every import used to leave a folder in /tmp), and removed at exit."""
    folder = Path(tempfile.mkdtemp(prefix="millstream-stress-keys-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder / "keys"


def stress_once(args: list[str]) -> dict:
    """One stress run (command-line `args`, without --out) in a scratch folder, removed after it
    (kept, with its run's logs, when it fails); returns its report. For benchmarks that compare
    many runs in one process."""
    with scratch("millstream-stress-") as out:
        return run_stress(
            stress_parser().parse_args(
                [*args, "--out", str(out), "--set", f"transport.keys_dir={_shared_keys()}"]
            )
        )


def main(argv: list[str] | None = None) -> None:
    ns = stress_parser().parse_args(argv)
    try:
        report = run_stress(ns)
    except (ValueError, TypeError, ConfigError, KeyError) as exc:
        message = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        print(f"millstream stress: {message}", file=sys.stderr)
        sys.exit(2)
    except RuntimeError as exc:
        print(f"millstream stress: {exc}", file=sys.stderr)
        sys.exit(1)
    sys.exit(1 if report["lost"] else 0)


if __name__ == "__main__":
    main()
