"""What many tests need: start a process and wait for its ready file, stand in for the learner,
run `millstream run` as a user would. Not a test module.
"""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import anyio
import orjson
import pytest
import zmq

from millstream.bench.kit.spawn import spawn, stop
from millstream.envpool.actors.client import ActorClient
from millstream.shared.config import Config, EnvPoolConfig, TransportConfig
from millstream.shared.obs.metrics import read_jsonl, step_records
from millstream.shared.process.lifecycle import ENV_PARENT
from millstream.shared.process.runtime import free_port
from millstream.shared.store.trajstore import STORE_FILE
from millstream.shared.store.trajstore import read_episodes as read_store
from millstream.shared.wire import (
    Codec,
    EpisodeFailed,
    ErrorReply,
    PolicyVersion,
    PoolDone,
    ReplyCause,
    Trajectory,
)
from millstream.shared.wire.keys import RunKeys, ensure_keys, load_keys, secure
from millstream.shared.wire.transport import open_channel

ROOT = Path(__file__).resolve().parent.parent
MILLSTREAM = [sys.executable, "-m", "millstream.shared.launch.cli"]

#: One CURVE key folder for the test session: the session's actors, the stand-in learner, the
#: test's own clients and every run that connects to a session actor use it (a run with its own
#: actor could use its own `<run.dir>/keys`; sharing these changes nothing for it).
KEYS_DIR = ensure_keys(Path(tempfile.mkdtemp(prefix="millstream-test-")) / "keys")
atexit.register(shutil.rmtree, KEYS_DIR.parent, ignore_errors=True)
#: Processes a test starts stop when this test session is gone, even killed (shared/process/lifecycle.py).
WATCHED = {ENV_PARENT: str(os.getpid())}
#: The override that points a role or a run at the session's keys.
KEYS = f"transport.keys_dir={KEYS_DIR}"


#: The test running now (set by conftest), so that helpers that start the real stack can insist
#: that it is marked `real`.
CURRENT_TEST: Any = None


def require_real(what: str) -> None:
    """Fail the running test unless it is marked `real`: it `what` (vLLM, DeepSpeed, a run)."""
    if CURRENT_TEST is not None and CURRENT_TEST.get_closest_marker("real") is None:
        pytest.fail(f"{CURRENT_TEST.nodeid} {what}: mark it `real` (make test-fast skips those)")


class Recorder:
    """Wraps a client (the production `ActorClient` or `Router`): remembers each request's
    prompt and each generation, so a test can compare what an episode recorded with what the
    actor was asked and sampled."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self.prompts: list[list[int]] = []
        self.generations: list[Any] = []

    async def generate(self, prompt_token_ids: list[int], sampling: Any, **kwargs: Any) -> Any:
        self.prompts.append(list(prompt_token_ids))
        gen = await self.client.generate(prompt_token_ids, sampling, **kwargs)
        self.generations.append(gen)
        return gen


def keys_for(role: str, folder: Path = KEYS_DIR, worker: int | None = None) -> RunKeys:
    """The keys in `folder` (default: the session's) as `role` ("learner", "envpool",
    "actor") holds them; with `worker`, as that envpool worker holds them."""
    workers = EnvPoolConfig(workers=max(1, (worker or 0) + 1))
    keys = load_keys(Config(transport=TransportConfig(keys_dir=str(folder)), envpool=workers), role, worker)
    assert keys is not None
    return keys


def wait_for_file(
    path: Path, proc: subprocess.Popen, timeout_s: float, what: str, log: Path | None = None
) -> None:
    """Poll until `path` exists; fail naming `what` if `proc` exits first or time runs out."""
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if proc.poll() is not None:
            detail = log.read_text()[-3000:] if log and log.exists() else ""
            if not detail and proc.stderr is not None:
                detail = proc.stderr.read().decode(errors="replace")[-3000:]
            pytest.fail(f"{what} exited with {proc.returncode} before it was ready:\n{detail}")
        if time.monotonic() > deadline:
            stop(proc, grace_s=0)
            pytest.fail(f"{what} not ready in {timeout_s}s")
        time.sleep(0.1)


class RunningActor:
    """A started actor process: its address, process, log file and model directory."""

    def __init__(self, address: str, proc: subprocess.Popen, log: Path, model_dir: str) -> None:
        self.address = address
        self.proc = proc
        self.log = log
        self.model_dir = model_dir


@contextmanager
def running_actor(model_dir: str, workdir: Path, *overrides: str) -> Iterator[RunningActor]:
    """An actor (`start_actor`) for the length of a `with`, stopped by SIGTERM to its group after."""
    address, proc, log = start_actor(model_dir, workdir, *overrides)
    try:
        yield RunningActor(address, proc, log, model_dir)
    finally:
        stop(proc, grace_s=30)


def start_actor(
    model_dir: str,
    workdir: Path,
    *overrides: str,
    address: str | None = None,
    env: dict[str, str] | None = None,
    timeout_s: float = 600,
) -> tuple[str, subprocess.Popen, Path]:
    """An actor process through its real entry point, ready; returns (address, proc, log).

    It runs in a process group of its own (stop it with `bench/kit/spawn.stop`); its output goes to the
    log, which a failed start shows."""
    if "actor.kind=synthetic" not in overrides:
        require_real("starts a vLLM actor")
    address = address or f"tcp://127.0.0.1:{free_port()}"
    port = address.rsplit(":", 1)[1]
    ready, log = workdir / f"actor-{port}.json", workdir / f"actor-{port}.log"
    cmd = [
        sys.executable,
        "-m",
        "millstream.actor",
        "--ready-file",
        str(ready),
        f"model.path={model_dir}",
        f"actor.address={address}",
        KEYS,
        *overrides,
    ]
    with log.open("wb") as out:
        # A group of its own in the test's session, as the launcher places roles.
        env = dict(os.environ, PYTHONUNBUFFERED="1", **WATCHED, **(env or {}))
        proc = spawn(cmd, cwd=ROOT, stdout=out, stderr=out, env=env)
    wait_for_file(ready, proc, timeout_s, f"the actor ({' '.join(overrides)})", log=log)
    return address, proc, log


def start_synthetic_actor(
    model_dir: str, workdir: Path, *overrides: str, address: str | None = None
) -> tuple[str, subprocess.Popen]:
    """The synthetic actor (actor/synthetic.py) as a process, ready; returns (address, proc)."""
    address, proc, _ = start_actor(
        model_dir, workdir, "actor.kind=synthetic", *overrides, address=address, timeout_s=120
    )
    return address, proc


class StandInLearner:
    """The learner's two sockets and nothing else: announce versions, collect what workers push.

    `config()` gives the overrides that point an envpool worker at it. `pump()` announces the
    current (version, limit, final) and reads what arrived; `received` keeps every message.
    """

    def __init__(self) -> None:
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self.pull, self.pub = ctx.socket(zmq.PULL), ctx.socket(zmq.PUB)
        secure(self.pull, keys_for("learner"), bind=True)
        secure(self.pub, keys_for("learner"), bind=True)
        self.pull.set_hwm(0)  # the stand-in must never make a worker's PUSH block
        self.experience_port = self.pull.bind_to_random_port("tcp://127.0.0.1")
        self.version_port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        self.codec = Codec()
        self.received: list = []
        self.outcomes: Counter = Counter()  # "trajectory" or the failure cause
        self.done: list[PoolDone] = []

    def config(self) -> list[str]:
        return [
            f"learner.experience_address=tcp://127.0.0.1:{self.experience_port}",
            f"learner.version_address=tcp://127.0.0.1:{self.version_port}",
            KEYS,
        ]

    def announce(self, version: int, admit_limit: int, final: bool = False) -> None:
        self.pub.send(self.codec.encode([PolicyVersion(version, admit_limit, 0, final=final)]))

    def drain(self, wait_ms: int = 0) -> list:
        """Read every message that arrives within `wait_ms`; returns the new ones."""
        new = []
        while self.pull.poll(wait_ms):
            new.extend(self.codec.decode(self.pull.recv()))
        for m in new:
            if isinstance(m, Trajectory):
                self.outcomes["trajectory"] += 1
            elif isinstance(m, EpisodeFailed):
                self.outcomes[str(m.cause)] += 1
            elif isinstance(m, PoolDone):
                self.done.append(m)
        self.received.extend(new)
        return new

    @property
    def episodes(self) -> int:
        return sum(self.outcomes.values())

    def close(self) -> None:
        self.pull.close(0)
        self.pub.close(0)


async def with_client(address: str, body, *, name: str = "test"):
    """Run `body(client, tg)` with an ActorClient connected to `address`; returns its result.

    `tg` is the task group the client runs in (a test may start a scripted peer there). An
    exception of `body` is raised as itself, not inside an ExceptionGroup.
    """
    channel = open_channel("dealer", address, bind=False, cfg=TransportConfig(), keys=keys_for("envpool"))
    client = ActorClient(channel, name)
    outcome: dict = {}
    async with anyio.create_task_group() as tg:
        tg.start_soon(channel.run)
        tg.start_soon(client.run)
        try:
            outcome["value"] = await body(client, tg)
        except Exception as exc:
            outcome["error"] = exc
        tg.cancel_scope.cancel()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def dealer(address: str, role: str = "envpool") -> zmq.Socket:
    """A raw ZeroMQ peer holding the run's `role` key, for tests that speak the wire protocol
    frame by frame (a hostile peer inside the run; a test that watches each delta)."""
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    secure(sock, keys_for(role), bind=False)
    sock.connect(address)
    return sock


def raw_replies(sock: zmq.Socket, wait_s: float, done=lambda out: False) -> list:
    """The messages that arrive on `sock` within `wait_s`, or until `done(all so far)`."""
    codec, out = Codec(), []
    deadline = time.monotonic() + wait_s
    while sock.poll(max(1, int((deadline - time.monotonic()) * 1000))):
        out.extend(codec.decode(sock.recv()))
        if done(out) or time.monotonic() > deadline:
            break
    return out


def replies(sock: zmq.Socket, wait_s: float, until: ReplyCause | None = None) -> list:
    """What arrives within `wait_s`, or until an ErrorReply of cause `until` has."""

    def arrived(out: list) -> bool:
        return until is not None and any(isinstance(m, ErrorReply) and m.cause == until for m in out)

    return raw_replies(sock, wait_s, arrived)


# --- `millstream run` as a user runs it --------------------------------------------------------


def millstream_run(
    actor, run_dir: Path, *overrides: str, timeout: float = 900
) -> subprocess.CompletedProcess:
    """`millstream run` against the session's actor; fails the test with every log if it fails."""
    require_real("runs `millstream run`")
    cmd = [
        *MILLSTREAM,
        "run",
        KEYS,
        f"actor.connect={actor.address}",
        f"model.path={actor.model_dir}",
        f"run.dir={run_dir}",
        *overrides,
    ]
    proc = subprocess.run(
        cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=dict(os.environ, **WATCHED)
    )
    if proc.returncode != 0:
        logs = "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in (run_dir / "logs").glob("*.log"))
        pytest.fail(
            f"millstream run failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n"
            f"{proc.stderr[-3000:]}\n{logs}"
        )
    return proc


#: Launchers started by `start_run`; conftest kills any still running after each test, so a
#: failed assertion never leaves a run behind (its roles then stop by themselves).
LAUNCHED: list[subprocess.Popen] = []


def start_run(
    run_dir: Path, *overrides: str, until: str = "step ", timeout_s: float = 400
) -> subprocess.Popen:
    """`millstream run` in the background, returned once a line starting with `until` appeared
    (by default: the first step line, training is under way)."""
    require_real("runs `millstream run`")
    proc = subprocess.Popen(
        [*MILLSTREAM, "run", f"run.dir={run_dir}", KEYS, *overrides],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=dict(os.environ, **WATCHED),
    )
    LAUNCHED.append(proc)  # conftest stops it if the test ends before it does
    seen: list[str] = []
    deadline = time.monotonic() + timeout_s
    assert proc.stdout is not None
    for line in proc.stdout:
        seen.append(line)
        if line.startswith(until) or time.monotonic() > deadline:
            break
    if not seen or not seen[-1].startswith(until):
        proc.kill()
        pytest.fail(f"no line starting with {until!r}:\n{''.join(seen)[-3000:]}")
    return proc


def live_turns(run_dir: Path, replica: str | None = None) -> int:
    """Turns live on the actor (or on one replica of it) at each envpool worker's last
    statistics record (`envpool-w*.jsonl`; a line being written is skipped)."""
    total = 0
    for path in run_dir.glob("envpool-w*.jsonl"):
        records = read_jsonl(path)
        client = records[-1]["client"] if records else {}
        total += (
            client.get("live", 0)
            if replica is None
            else client.get("replicas", {}).get(replica, {}).get("live", 0)
        )
    return total


def steps_of(run_dir: Path) -> list[dict]:
    """The step records of a run, without the ones a resume rolled back."""
    return step_records(read_jsonl(run_dir / "metrics.jsonl"))


def check_accounting(run_dir: Path, workers: int = 1) -> dict:
    """summary.json adds up, and the trajectory store agrees with it; returns the summary."""
    summary = orjson.loads((run_dir / "summary.json").read_bytes())
    accounted = (
        summary["episodes_trained"]
        + sum(summary["episodes_dropped"].values())
        + sum(summary["episodes_failed"].values())
    )
    # Refused episodes no worker started (a hostile peer's) are received but not the run's.
    assert summary["episodes_started"] == accounted - summary["episodes_foreign"] > 0
    assert summary["accounting_ok"] is True and summary["workers_done"] == workers
    assert summary["duplicates"] == 0 and summary["decode_errors"] == 0
    # The trajectory store holds every episode of the accounting line, each once.
    records = [r for r in read_episodes(run_dir) if not r["rolled_back"]]
    fates = Counter(r["fate"] for r in records)
    assert fates["trained"] == summary["episodes_trained"]
    # learner_lost is a count (the results died with a learner process), not records; so is the
    # part of worker_lost a dead worker's lineage file told of (envpool/lineage.py: no ids).
    failed = Counter(r["cause"] for r in records if r["fate"] == "failed")
    counted = Counter({k: v for k, v in summary["episodes_failed"].items() if k != "learner_lost"})
    counted["worker_lost"] -= summary.get("worker_lost_unheard", 0)
    assert failed == +counted
    # Refused episodes (invalid_trajectory) may be forged: counted, never recorded as the run's.
    dropped = Counter(r["cause"] for r in records if r["fate"] == "dropped")
    assert dropped == Counter(
        {k: v for k, v in summary["episodes_dropped"].items() if k != "invalid_trajectory"}
    )
    assert len({r["episode_id"] for r in records}) == len(records)
    return summary


# --- a hostile peer on the same machine ----------------------------------------------------------


def read_episodes(run_dir: Path) -> list[dict[str, Any]]:
    """Every episode record of a run, from its trajectory store (shared/store/trajstore.py)."""
    return read_store(run_dir / STORE_FILE)


def run_started_again(
    code: str, argv: list[str], env: dict[str, str], timeout_s: float = 120
) -> tuple[subprocess.CompletedProcess, list[str], str]:
    """Run `code`, which prints "start <pid>" and then calls `run_role(..., preload=True)`, and
    check that it ran once more as the same process (the actor starting itself again with its
    allocator and OpenMP settings). Returns the run, its output lines and the pid."""
    out = subprocess.run(
        [sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=timeout_s, env=env
    )
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    starts = [line for line in lines if line.startswith("start ")]
    assert len(starts) == 2 and len(set(starts)) == 1, lines  # started again, same pid
    return out, lines, starts[0].split()[1]
