"""`millstream run`: check a config, start actor, learner and envpool workers, supervise them.

    millstream run [config.toml] [dotted.key=value ...]

What it does:
1. **checks everything it can before anything starts** (`prepare`): the config's keys, types,
   choices and addresses (shared/config/load.py); the model directory (the tiny model is built if
   `model.path` is empty) and that the actor's `tensor_parallel_size` can split that model; the
   envpool's own settings, by running `millstream envpool --check` (the environment's name and
   arguments, the tokenizer, a first prompt against `actor.max_model_len`); and for
   `run.resume`, that the checkpoint's run used the same model, environment and algorithm
   (shared/store/rundir.py). A problem is one line naming the key, exit status 2, and no run
   directory is made.
2. makes the run directory (a resumed run continues in its own, and the records written after
   its checkpoint are marked rolled back) and writes `config.toml`, the resolved config every
   role reads;
3. starts the roles (`python -m millstream.actor|learner|envpool`), each in its own process
   group (shared/process/supervisor.py), shows the learner's progress lines, and watches: the run ends
   when the learner exits; any role ending first stops the others at once, and the message
   names the role, why it ended and how to resume from the latest checkpoint;
4. on Ctrl-C or SIGTERM stops every process (SIGTERM, then SIGKILL after a grace period). If
   this launcher is killed outright, its children notice and stop themselves
   (shared/process/lifecycle.py).

The launcher imports no role package: roles are processes, joined only by the addresses in the
config, so the same roles can be placed on other hosts by a cluster manager instead:
`launcher.kind = "ray"` has Ray actors start them on a Ray cluster (shared/launch/ray/launch.py,
docs/multihost.md); the watching and healing above stay the same.
"""

from __future__ import annotations

import re
import shutil
import signal
import sys
import threading
import time
import tomllib
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import IO, Any, cast

import orjson

from millstream.shared.config import (
    Config,
    ConfigError,
    dump_config,
    load_config,
    parse_overrides,
    toml_value,
)
from millstream.shared.launch import preflight
from millstream.shared.launch.healing import Healer, watch
from millstream.shared.launch.output import RunOutput
from millstream.shared.launch.progress import StartupProgress
from millstream.shared.process.gpus import gpu_plan, role_gpus
from millstream.shared.process.lifecycle import watch_parent
from millstream.shared.process.runtime import check_model_dir, free_port, ready_file, resolve_model_dir
from millstream.shared.process.supervisor import LineStream, RoleProcesses, Supervisor
from millstream.shared.store.rundir import (
    Resume,
    checkpoint_step,
    find_checkpoint,
    mark_rolled_back,
    plan_resume,
    resume_conflicts,
    retire_later_checkpoints,
)
from millstream.shared.wire.keys import ensure_keys
from millstream.shared.wire.replicas import replica_name

__all__ = ["launch", "prepare", "Plan"]

#: Addresses the launcher fills in when their port is 0.
_PICKED = ("actor.address", "learner.experience_address", "learner.version_address", "judge.address")


@dataclass
class Plan:
    """A checked run, ready to start."""

    cfg: Config
    run_dir: Path
    resume: Resume | None
    #: Differences from the checkpoint's run that a resume allows (reported, not refused).
    changed: list[str]

    @property
    def finished(self) -> bool:
        """A resumed run whose checkpoint is already at train.steps: nothing to do."""
        return self.resume is not None and self.resume.step >= self.cfg.train.steps


def prepare(cfg_path: str | None, overrides: list[str]) -> Plan:
    """Every check that can run before a role starts (step 1 above); no side effects but
    building the tiny model. Raises ConfigError naming the key."""
    resume = _find_resume(cfg_path, overrides)
    base: str | Path | None = cfg_path
    if resume is not None and cfg_path is None:
        # Resuming without a config file continues the run as it was configured (ports are
        # picked afresh); overrides still apply, and are checked against it below.
        base = resume.run_dir / "config.toml"
        overrides = [
            *(f"{key}={_q(_port_zero(_get(resume.previous, key)))}" for key in _PICKED),
            "actor.replica_addresses=[]",  # picked afresh from actor.address
            *overrides,
        ]
    cfg = load_config(base, overrides)
    run_dir = resume.run_dir if resume else _new_run_dir(cfg)
    cfg = load_config(base, overrides + _resolved(cfg, run_dir))
    plan = Plan(cfg, run_dir, resume, [])
    if plan.finished:
        return plan
    preflight.check_run_dir(run_dir, resuming=resume is not None)
    preflight.check_actor(cfg)
    preflight.check_sampling(cfg)
    preflight.check_bind_addresses(cfg)
    if cfg.launcher.kind == "ray":
        from millstream.shared.launch.ray.cluster import check_cluster  # ray is an optional dependency

        check_cluster(cfg)
    preflight.check_roles(cfg)
    if resume is not None:
        refused, plan.changed = resume_conflicts(resume.previous, cfg)
        if refused:
            raise ConfigError(
                f"run.resume = {cfg.run.resume!r}: the checkpoint's run differs in "
                f"keys a resume must keep: {'; '.join(refused)}"
            )
    return plan


def launch(
    cfg_path: str | None, overrides: list[str], *, out: IO[str] = sys.stdout, quiet: bool = False
) -> int:
    """Run a whole job; returns the process exit code (0: finished and accounting holds).
    `quiet`: no start-up lines (shared/launch/progress.py), only the step lines and the end."""
    plan = prepare(cfg_path, overrides)
    if plan.finished:
        assert plan.resume is not None
        print(
            f"millstream run: {plan.run_dir} already finished: its checkpoint is at step "
            f"{plan.resume.step} and train.steps = {plan.cfg.train.steps}; nothing started. To "
            f"train further: millstream run run.resume={plan.run_dir} train.steps=N",
            file=out,
            flush=True,
        )
        return 0
    _make_run_dir(plan, out)
    return _supervise(plan.cfg, plan.run_dir, out, quiet)


def _find_resume(cfg_path: str | None, overrides: list[str]) -> Resume | None:
    """The run to resume, from the overrides or the config file (read, not yet checked)."""
    where = parse_overrides(overrides).get("run", {}).get("resume")
    if where is None and cfg_path is not None:
        where = _read_toml(cfg_path).get("run", {}).get("resume")
    return plan_resume(str(where)) if where else None


def _read_toml(path: str) -> dict[str, Any]:
    try:
        return tomllib.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None


def _new_run_dir(cfg: Config) -> Path:
    if cfg.run.dir:
        return Path(cfg.run.dir)
    return Path(cfg.run.root) / f"{cfg.run.name}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"


def _resolved(cfg: Config, run_dir: Path) -> list[str]:
    """Overrides that pin what the roles must agree on: the run directory, the model directory
    (the tiny model is built here if needed), and a free port for every address at port 0."""
    resolved = [f"run.dir={_q(str(run_dir.resolve()))}", f"model.path={_q(resolve_model_dir(cfg))}"]
    if cfg.transport.curve:
        keys = Path(cfg.transport.keys_dir or run_dir / "keys").resolve()
        resolved.append(f"transport.keys_dir={_q(str(keys))}")
    resolved += [f"{key}={_q(_with_port(_get(cfg, key)))}" for key in _PICKED if key != "actor.address"]
    if not cfg.actor.connect:
        addresses = _replica_addresses(cfg)
        resolved += [f"actor.address={_q(addresses[0])}", f"actor.replica_addresses={toml_value(addresses)}"]
    if cfg.judge.model_path:
        judge = str(check_model_dir(cfg.judge.model_path, "judge.model_path").resolve())
        resolved.append(f"judge.model_path={_q(judge)}")
    return resolved


def _replica_addresses(cfg: Config) -> list[str]:
    """One bind address per replica: those listed (ports 0 filled in), else from actor.address:
    a free port each when its port is 0, else consecutive ports from it."""
    if cfg.actor.replica_addresses:
        return [_with_port(a) for a in cfg.actor.replica_addresses]
    base = cfg.actor.address
    if not base.startswith("tcp://"):  # ipc://path: path, path-1, path-2, ...
        return [base] + [f"{base}-{i}" for i in range(1, cfg.actor.replicas)]
    if base.endswith(":0"):
        picked: list[str] = []
        while len(picked) < cfg.actor.replicas:  # the OS may hand out a port twice
            address = _with_port(base)
            picked += [] if address in picked else [address]
        return picked
    host, port = base.rsplit(":", 1)
    return [f"{host}:{int(port) + i}" for i in range(cfg.actor.replicas)]


def _make_run_dir(plan: Plan, out: IO[str]) -> None:
    run_dir = plan.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "logs").mkdir(exist_ok=True)
    if plan.resume is not None:
        previous = run_dir / "config.toml"
        shutil.copyfile(previous, run_dir / f"config-before-step-{plan.resume.step}.toml")
        retire_later_checkpoints(run_dir, plan.resume.step)
        marked = mark_rolled_back(run_dir, plan.resume.records, plan.resume.step)
        print(
            f"millstream run: resuming {run_dir} from step {plan.resume.step}; records after "
            f"it marked rolled back: {marked}",
            file=out,
        )
        for line in plan.changed:
            print(f"  changed since the checkpoint: {line}", file=out)
    if plan.cfg.transport.curve:
        ensure_keys(plan.cfg.transport.keys_dir, plan.cfg.envpool.workers)  # before any role starts
    (run_dir / "config.toml").write_text(dump_config(plan.cfg))


def _supervise(cfg: Config, run_dir: Path, out: IO[str], quiet: bool = False) -> int:
    # A launcher started by a process that watches over it (a test session, a job script
    # given MILLSTREAM_PARENT_PID) stops its run, in order, when that process is gone.
    watch_parent()
    config = ["--config", str(run_dir / "config.toml")]
    sup = _supervisor(cfg, run_dir)
    stop = threading.Event()
    out = cast(IO[str], RunOutput(out, stop))  # a broken stdout stops the run (shared/launch/output.py)
    print(f"millstream run: {run_dir}", file=out, flush=True)
    plan = gpu_plan(cfg)  # shared/process/gpus.py: which GPUs each GPU process computes on
    if plan:
        print(f"millstream run: GPUs: {plan}", file=out, flush=True)
    old = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGINT, signal.SIGTERM)}
    relays: list[threading.Thread] = []

    def relay_learner() -> None:  # at its start, and again after each restart
        relays.append(threading.Thread(target=_relay, args=(sup.output("learner"), out), daemon=True))
        relays[-1].start()

    try:
        with sup.starting():  # Ray reserves every role's resources at once, then starts them
            names = _start_roles(sup, cfg, config)
        relay_learner()
        local = cfg.launcher.kind == "local"  # on Ray, the ready files are on the roles' hosts
        progress = StartupProgress(run_dir, names, out) if local and not quiet else None
        code = watch(sup, stop, out, Healer(cfg, run_dir), relay_learner, progress)
    finally:
        stopping = time.monotonic()
        sup.stop(grace_s=10.0)
        for relay in relays:
            relay.join(timeout=5)  # after the stop: the learner's last lines, then end of pipe
        took = time.monotonic() - stopping
        print(f"millstream run: every process stopped ({took:.1f}s)", file=out, flush=True)
        for sig, handler in old.items():
            signal.signal(sig, handler)
    if code == 0:
        _print_summary(run_dir, out)
    else:
        print(_resume_hint(run_dir), file=out, flush=True)
    return code


def _supervisor(cfg: Config, run_dir: Path) -> RoleProcesses:
    """Children of this process (`launcher.kind = "local"`) or Ray actors' (`"ray"`)."""
    if cfg.launcher.kind == "ray":
        from millstream.shared.launch.ray.launch import RaySupervisor

        return RaySupervisor(cfg, run_dir)
    return Supervisor(run_dir)


def _start_roles(sup: RoleProcesses, cfg: Config, config: list[str]) -> list[str]:
    """Start every role; returns the names of those that say when they are ready (all but a
    data-parallel learner's follower ranks)."""

    names: list[str] = []

    def args(name: str, *more: str) -> list[str]:
        names.append(name)
        if cfg.launcher.kind != "local":  # on Ray the run directory may not exist where it runs
            return [*config, *more]
        return [*config, "--ready-file", str(ready_file(cfg.run.dir, name)), *more]  # progress.py

    def gpus(role: str, index: int = 0, *, judge: bool = False) -> dict[str, str]:
        visible = role_gpus(cfg, role, index, judge=judge)  # shared/process/gpus.py
        return {} if visible is None else {"CUDA_VISIBLE_DEVICES": visible}

    if not cfg.actor.connect:
        for index in range(cfg.actor.replicas):
            name = replica_name(index)
            replica = args(name, "--worker-index", str(index))
            sup.start(name, "millstream.actor", replica, env=gpus("actor", index))
    if cfg.judge.model_path and not cfg.judge.connect:
        sup.start("judge", "millstream.actor", args("judge", "--judge"), env=gpus("actor", judge=True))
    # Rank 0 is "learner" (it talks to the run and prints the progress lines); the other ranks
    # of a data-parallel learner follow it. Not torchrun: its agent's TCPStore listens on every
    # interface; rank 0 hosts the group's store on loopback instead (learner/train/dssetup.py).
    port = str(free_port())
    for rank in range(cfg.learner.ranks):
        ranks = dict(
            RANK=str(rank),
            # Rank r computes on the r-th of the learner's GPUs; under Ray each rank sees its own.
            LOCAL_RANK=str(rank) if cfg.launcher.kind == "local" else "0",
            WORLD_SIZE=str(cfg.learner.ranks),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port,
        )
        env = {**(ranks if cfg.learner.ranks > 1 else {}), **gpus("learner")}
        name = "learner" if rank == 0 else f"learner-rank{rank}"
        sup.start(
            name,
            "millstream.learner",
            args(name) if rank == 0 else config,
            pipe_stdout=rank == 0,
            env=env or None,
        )
    for i in range(cfg.envpool.workers):
        sup.start(f"envpool-{i}", "millstream.envpool", args(f"envpool-{i}", "--worker-index", str(i)))
    return names


def _resume_hint(run_dir: Path) -> str:
    try:
        checkpoint = find_checkpoint(run_dir)
    except FileNotFoundError:
        return "no checkpoint was saved yet (learner.checkpoint_every), so the run cannot be resumed"
    return (
        f"latest checkpoint: {checkpoint} (step {checkpoint_step(checkpoint)}); resume "
        f"with: millstream run run.resume={run_dir}"
    )


def _relay(stream: LineStream, out: IO[str]) -> None:
    """The learner's lines to `out` (a `RunOutput`: when it breaks, the run stops and the lines
    are read on, so that the learner never blocks on its pipe)."""
    for line in iter(stream.readline, b""):
        out.write(line.decode(errors="replace"))
        out.flush()


def _print_summary(run_dir: Path, out: IO[str]) -> None:
    path = run_dir / "summary.json"
    if not path.exists():
        return
    summary = orjson.loads(path.read_bytes())
    started = f"started {summary['episodes_started']}"
    if summary.get("learner_sessions", 1) > 1:
        started += f" (over {summary['learner_sessions']} learner sessions)"
    # An episode the run's end caught (finished in a group still incomplete, or still running)
    # is neither a drop nor a failure: said once, on its own (summary.json keeps both counts).
    dropped, failed = dict(summary["episodes_dropped"]), dict(summary["episodes_failed"])
    waiting, running = dropped.pop("run_ended", 0), failed.pop("run_ended", 0)
    ended = (
        f", left at the end {waiting + running} ({waiting} finished in incomplete groups, {running} running)"
    )
    print(
        f"episodes: {started}, trained {summary['episodes_trained']}"
        f"{ended if waiting + running else ''}, dropped {dropped}, failed {failed} "
        f"(accounting {'ok' if summary['accounting_ok'] else 'BROKEN'})",
        file=out,
    )
    print(
        f"final weights: {summary['final_weights']}; metrics: {run_dir / 'metrics.jsonl'}",
        file=out,
        flush=True,
    )


def _get(cfg: Config, dotted: str) -> Any:
    section, key = dotted.split(".")
    return getattr(getattr(cfg, section), key)


def _with_port(address: str) -> str:
    """`tcp://host:0` with a free port of `host` filled in; other addresses as they are."""
    if address.startswith("tcp://") and address.endswith(":0"):
        host = address[len("tcp://") : -2]
        return f"tcp://{host}:{free_port(host.strip('[]'))}"
    return address


def _port_zero(address: str) -> str:
    return re.sub(r":\d+$", ":0", address) if address.startswith("tcp://") else address


def _q(text: str) -> str:
    return orjson.dumps(text).decode()
