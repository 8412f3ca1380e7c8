"""The processes of one run: start them, watch them, say why one ended, stop them all.

Each role runs as `python -m millstream.<role>` in a process group of its own (in the
launcher's session, so that the kernel schedules the run's processes as one), so stopping it
also stops what it spawned (vLLM's EngineCore and Workers, torchrun's ranks). Each child is told
three things in its environment (shared/process/lifecycle.py and shared/process/runtime.py read them):

    MILLSTREAM_PARENT_PID  this process: a child whose parent is gone stops by itself
    MILLSTREAM_RUN         the run directory: every process of the run can be found by it
    MILLSTREAM_NAME        the child's name ("actor", "envpool-0"): where it writes why it failed

`describe_exit` turns an exit into words: the cause the role wrote (`logs/<name>.exit.json`),
else the signal that killed it, else its exit status and the end of its log.

`RoleProcesses` is what the launcher and `healing.watch` ask of a supervisor: `Supervisor` here
(children of the launcher, on this host) or `RaySupervisor` (shared/launch/ray/launch.py: the same roles
started by Ray actors on a Ray cluster, `launcher.kind = "ray"`).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import IO, Protocol

import orjson

from millstream.shared.process.lifecycle import ENV_PARENT, ENV_RUN, live_group, signal_group, stop_groups
from millstream.shared.process.runtime import ENV_NAME, STOPPED, exit_file, ready_file

__all__ = ["Supervisor", "RoleProcesses", "LineStream", "describe_exit", "tail_log"]


class LineStream(Protocol):
    """A role's stdout, line by line: `readline()` gives b"" once it ended."""

    def readline(self) -> bytes: ...


class RoleProcesses(Protocol):
    """The processes of one run as the launcher and `healing.watch` use them."""

    @property
    def procs(self) -> Mapping[str, object]:
        """Every role started, by name (the values are the supervisor's own)."""
        ...

    def starting(self) -> AbstractContextManager[None]:
        """Around the first `start` calls: a supervisor may reserve their resources together."""
        ...

    def start(
        self,
        name: str,
        module: str,
        args: list[str],
        *,
        pipe_stdout: bool = False,
        env: dict[str, str] | None = None,
    ) -> None: ...

    def restart(self, name: str, extra_args: list[str] | None = None) -> None: ...

    def kill(self, name: str) -> None: ...

    def exited(self) -> dict[str, int]: ...

    def output(self, name: str) -> LineStream:
        """The stdout of a role started with `pipe_stdout`."""
        ...

    def stop(self, grace_s: float = 15.0) -> None: ...

    def tail(self, name: str, lines: int = 15) -> str: ...

    def describe_exit(self, name: str, code: int) -> str: ...


class Supervisor:
    """Child processes of one run, each in its own process group."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.logs: dict[str, Path] = {}
        #: How each child was started, so `restart` can start it again.
        self.specs: dict[str, tuple[str, list[str], bool, dict[str, str] | None]] = {}

    def start(
        self,
        name: str,
        module: str,
        args: list[str],
        *,
        pipe_stdout: bool = False,
        env: dict[str, str] | None = None,
    ) -> None:
        log = self.run_dir / "logs" / f"{name}.log"
        self.logs[name] = log
        self.specs[name] = (module, args, pipe_stdout, env)
        exit_file(self.run_dir, name).unlink(missing_ok=True)  # a previous session's
        ready_file(self.run_dir, name).unlink(missing_ok=True)
        out: IO[bytes] = log.open("ab")
        child_env = dict(
            os.environ,
            PYTHONUNBUFFERED="1",
            **(env or {}),
            **{ENV_PARENT: str(os.getpid()), ENV_RUN: str(self.run_dir.resolve()), ENV_NAME: name},
        )
        self.procs[name] = subprocess.Popen(
            [sys.executable, "-m", module, *args],
            stdout=subprocess.PIPE if pipe_stdout else out,
            stderr=out,
            stdin=subprocess.DEVNULL,
            env=child_env,
            # A process group of its own (signals reach what the role spawned), in the
            # launcher's session: Linux's autogroup scheduler (`sched_autogroup_enabled`, on in
            # most distributions) shares the CPU between sessions first, and with the actor in
            # a session of its own the envpool waited up to half a second for a core while the
            # engine computed (bench/README.md, "Roles in one session").
            process_group=0,
        )
        out.close()  # the child holds its own copy
        (self.run_dir / f"{name}.pid").write_text(str(self.procs[name].pid))

    @contextmanager
    def starting(self) -> Iterator[None]:
        """Children start at once: nothing to reserve."""
        yield

    def output(self, name: str) -> LineStream:
        stdout = self.procs[name].stdout
        assert stdout is not None, f"{name} was started without pipe_stdout"
        return stdout

    def restart(self, name: str, extra_args: list[str] | None = None) -> None:
        """Kill what is left of `name`'s process group (a dead actor's engine processes hold
        its port and memory), then start it again as it was started (plus `extra_args`)."""
        proc = self.procs[name]
        if live_group(proc.pid, proc.poll()):  # the whole group gone, not the role alone
            stop_groups([proc.pid], grace_s=0)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:  # stuck in the kernel (a GPU driver): start anyway
            pass
        module, args, pipe_stdout, env = self.specs[name]
        self.start(name, module, [*args, *(extra_args or [])], pipe_stdout=pipe_stdout, env=env)
        self.specs[name] = (module, args, pipe_stdout, env)  # the extra arguments: this start only

    def kill(self, name: str) -> None:
        """SIGKILL `name`'s whole process group (fault injection)."""
        signal_group(self.procs[name].pid, signal.SIGKILL)

    def exited(self) -> dict[str, int]:
        return {n: p.returncode for n, p in self.procs.items() if p.poll() is not None}

    def stop(self, grace_s: float = 15.0) -> None:
        """Stop every role's whole group (`stop_groups`: SIGTERM, one wait of up to `grace_s` in
        all, SIGKILL to what is left) and return when none of their processes is alive, a role's
        EngineCore or torchrun ranks included, not only the roles themselves."""
        live = [proc.pid for proc in self.procs.values() if live_group(proc.pid, proc.poll())]
        left = stop_groups(live, grace_s)
        if left:  # stuck in the kernel: nothing more a signal can do; say so rather than hang
            print(f"millstream: processes {left} outlived SIGKILL", file=sys.stderr, flush=True)
        for proc in self.procs.values():
            try:
                proc.wait(timeout=10)  # reap the role (at once, unless it is stuck in the kernel)
            except subprocess.TimeoutExpired:
                pass

    def tail(self, name: str, lines: int = 15) -> str:
        return tail_log(self.logs[name], lines)

    def describe_exit(self, name: str, code: int) -> str:
        return describe_exit(self.run_dir, name, code, self.logs[name])


def tail_log(log: Path, lines: int = 15) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def describe_exit(run_dir: Path, name: str, code: int, log: Path) -> str:
    """Why `name` ended, in one line (plus the log's end when nothing better is known)."""
    cause = exit_file(run_dir, name)
    if cause.is_file():
        record = orjson.loads(cause.read_bytes())
        return f"{record['error']}: {record['message']}"
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    if code == STOPPED:
        return "stopped by a signal (SIGTERM or SIGINT)"
    return f"exit status {code}; its log {log} ends:\n{tail_log(log)}"
