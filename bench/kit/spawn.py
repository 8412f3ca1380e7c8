"""Start a benchmark's engine process as the launcher starts a role.

    proc = spawn([sys.executable, "-m", "millstream.actor", ...], stdout=log, stderr=log)
    ...
    os.killpg(proc.pid, signal.SIGKILL)  # the engine's own children go with it

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

__all__ = ["spawn"]


def spawn(command: list[str], **popen_kwargs: Any) -> subprocess.Popen:
    """`subprocess.Popen(command, **popen_kwargs)` in a process group of its own, in this session."""
    popen_kwargs.setdefault("stdin", subprocess.DEVNULL)
    return subprocess.Popen(command, process_group=0, **popen_kwargs)
