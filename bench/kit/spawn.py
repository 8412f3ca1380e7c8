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

import subprocess
from typing import Any

from millstream.shared.process.lifecycle import live_group, stop_groups

__all__ = ["spawn", "stop"]


def spawn(command: list[str], **popen_kwargs: Any) -> subprocess.Popen:
    """`subprocess.Popen(command, **popen_kwargs)` in a process group of its own, in this session."""
    popen_kwargs.setdefault("stdin", subprocess.DEVNULL)
    return subprocess.Popen(command, process_group=0, **popen_kwargs)


def stop(proc: subprocess.Popen, grace_s: float = 20.0) -> None:
    """Stop `proc`'s whole group and return only when none of it is left (`stop_groups`: SIGTERM,
    SIGKILL to what is left after `grace_s`; `grace_s=0` kills at once).

    Waiting for the group, not the leader alone, matters here: a vLLM actor's EngineCore and
    Worker are its children and outlive it by seconds, and a benchmark that starts the next
    engine at once would give their exit the cores of its warm-up (or find the port still held).
    """
    if live_group(proc.pid, proc.poll()):  # a reaped leader's empty group is nobody's to signal
        left = stop_groups([proc.pid], grace_s)
        if left:
            raise RuntimeError(f"processes {left} of group {proc.pid} outlived SIGKILL by 10 s")
    proc.wait(timeout=10)
