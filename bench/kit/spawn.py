"""Start a benchmark's engine process as the launcher starts a role.

    proc = spawn([sys.executable, "-m", "millstream.actor", ...], stdout=log, stderr=log)
    ...
    stop(proc)  # SIGTERM to its group, SIGKILL after 20 s; returns when the whole group is gone

Each process leads a group of its own, so the benchmark can signal it whole (a vLLM actor's
EngineCore is its child), and stays in the benchmark's session. Linux's autogroup scheduler
shares the CPU between sessions first: an engine in a session of its own got as much CPU as
every other session together, and the client that measured it sat runnable for 0.4-0.5 s at a
time (bench/README.md, "Roles in one session"). The launcher's `Supervisor` places roles the
same way (shared/process/supervisor.py); this is the benchmarks' copy, not an import of the
launcher's internals. Stdin is /dev/null unless given: a background process of a terminal's
session that read from it would be stopped (SIGTTIN).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from contextlib import suppress
from typing import Any

from millstream.shared.process.lifecycle import group_processes

__all__ = ["spawn", "stop"]


def spawn(command: list[str], **popen_kwargs: Any) -> subprocess.Popen:
    """`subprocess.Popen(command, **popen_kwargs)` in a process group of its own, in this session."""
    popen_kwargs.setdefault("stdin", subprocess.DEVNULL)
    return subprocess.Popen(command, process_group=0, **popen_kwargs)


def stop(proc: subprocess.Popen, grace_s: float = 20.0) -> None:
    """Stop `proc`'s whole group and return only when none of it is left.

    SIGCONT and SIGTERM first (a stopped process would hold SIGTERM pending), SIGKILL to what is
    left after `grace_s`; `grace_s=0` kills at once. Waiting for the group, not the leader alone,
    matters twice: a vLLM actor's EngineCore and Worker are its children and outlive it by
    seconds, and a benchmark that starts the next engine at once would give their exit the
    cores of its warm-up (or find the port still held).
    """
    if grace_s > 0:
        for sig in (signal.SIGCONT, signal.SIGTERM):
            with suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
        _wait_group_gone(proc.pid, grace_s)
    if group_processes(proc.pid):
        with suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        _wait_group_gone(proc.pid, 10.0)
    proc.wait(timeout=10)


def _wait_group_gone(pgid: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while group_processes(pgid) and time.monotonic() < deadline:
        time.sleep(0.1)
