"""What runs on each node of a Ray run (`launcher.kind = "ray"`, shared/launch/ray/launch.py): `RoleHost`, a
Ray actor that starts one role process beside itself and reports on it.

The role is `python -m millstream.<role>` with the Python of the Ray worker (every node runs the
same millstream install), in a session of its own, with the environment of its node (the one
`ray start` ran with, plus what Ray sets for its resources: `CUDA_VISIBLE_DEVICES`, and
`OMP_NUM_THREADS` = its CPUs, at least 1, unless the node's environment sets it) and the three
variables of shared/process/supervisor.py: `MILLSTREAM_PARENT_PID` = this Ray actor's process (a role
whose host died stops by itself, shared/process/lifecycle.py), `MILLSTREAM_RUN`, `MILLSTREAM_NAME`.

The actor is threaded (`max_concurrency`): `wait()` holds one thread for the role's life while
`signal()`, `stop()` and `read()` (the role's stdout, for the launcher to relay) use the others.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from millstream.shared.process.lifecycle import (
    ENV_PARENT,
    ENV_RUN,
    live_group,
    session_processes,
    signal_group,
    stop_groups,
)
from millstream.shared.process.runtime import ENV_NAME

__all__ = ["RoleHost", "Launch", "MAX_LINES"]

#: Lines of a role's stdout its host keeps for the launcher to read.
MAX_LINES = 10_000


@dataclass(frozen=True)
class Launch:
    """What a `RoleHost` needs to start its role (sent to the node)."""

    name: str
    module: str
    args: list[str]
    env: dict[str, str]
    run_dir: str
    cwd: str
    pipe_stdout: bool
    #: (node id, pid) of this role's previous process: its session is killed if on this node.
    leftover: tuple[str, int] | None


class RoleHost:
    """Starts one role process on this node (run as a threaded Ray actor by the launcher)."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen[bytes] | None = None
        self._lines: deque[bytes] = deque(maxlen=MAX_LINES)
        self._count = 0  # lines read so far, the ones `_lines` dropped included
        self._eof = False
        self._cond = threading.Condition()

    def start(self, job: Launch) -> tuple[int, str]:
        """Start the role; returns (its pid, this node's id)."""
        import ray

        node = ray.get_runtime_context().get_node_id()
        if job.leftover is not None and job.leftover[0] == node:
            _kill_session(job.leftover[1])  # a dead actor's engine processes hold its port
        run_dir = Path(job.run_dir)
        if not run_dir.is_dir():
            raise FileNotFoundError(
                f"run directory {run_dir} is not on node {socket.gethostname()}: run.dir must be on a "
                "filesystem every node mounts at the same path"
            )
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **job.env}
        env.update({ENV_PARENT: str(os.getpid()), ENV_RUN: job.run_dir, ENV_NAME: job.name})
        with (run_dir / "logs" / f"{job.name}.log").open("ab") as log:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", job.module, *job.args],
                stdout=subprocess.PIPE if job.pipe_stdout else log,
                stderr=log,
                stdin=subprocess.DEVNULL,
                env=env,
                cwd=job.cwd if os.path.isdir(job.cwd) else job.run_dir,
                start_new_session=True,
            )
        if job.pipe_stdout:
            threading.Thread(target=self._pump, daemon=True).start()
        return self._proc.pid, node

    def wait(self) -> int:
        assert self._proc is not None
        return self._proc.wait()

    def signal(self, sig: int) -> None:
        """`sig` to the role's process group; SIGKILL goes to its whole session."""
        if self._proc is None:
            return
        if sig == signal.SIGKILL:
            _kill_session(self._proc.pid)
        signal_group(self._proc.pid, sig)

    def stop(self, grace_s: float) -> list[int]:
        """Stop the role and everything it started, on this node; return once none is alive
        (or the pids that outlived SIGKILL).

        The role's group gets SIGTERM and `grace_s` to empty (`stop_groups`), so its children
        (vLLM's EngineCore and Worker, torchrun's ranks) finish their own stop after the role
        has exited rather than being SIGKILLed mid-way; then whatever of its session left the
        group is killed. Called for an exited role too: its group may still have members."""
        if self._proc is None:
            return []
        pid = self._proc.pid
        left = stop_groups([pid], grace_s) if live_group(pid, self._proc.returncode) else []
        _kill_session(pid)
        return left

    def read(self, start: int, wait_s: float) -> tuple[list[bytes], int, bool]:
        """Stdout lines from number `start` on, waiting up to `wait_s` for one; (lines, next
        number, ended)."""
        with self._cond:
            if start >= self._count and not self._eof:
                self._cond.wait(wait_s)
            first = self._count - len(self._lines)
            lines = list(self._lines)[max(0, start - first) :]
            return lines, self._count, self._eof and start + len(lines) >= self._count

    def _pump(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for line in iter(self._proc.stdout.readline, b""):
            with self._cond:
                self._lines.append(line)
                self._count += 1
                self._cond.notify_all()
        with self._cond:
            self._eof = True
            self._cond.notify_all()


def _kill_session(sid: int) -> None:
    for pid in session_processes(sid):
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
