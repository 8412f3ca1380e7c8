"""How a role process ends: on a signal, when its launcher dies, and with no child left behind.

Three ways a run's processes could outlive it, and what closes each:

- **A signal to a role** (SIGTERM from a cluster manager, Ctrl-C by hand). Python's default
  SIGTERM kills the process on the spot, so no `finally` runs: vLLM's EngineCore and Worker
  processes (over a GB) would run on forever. Every role turns SIGTERM into the same orderly
  stop as Ctrl-C (`stop_on_signals` for the learner's synchronous loop, `run_until_signal`
  inside the event loop of the actor and the envpool), so the engine's shutdown runs.
- **The launcher dies** (kill -9, a crashed login node). Its children are in process groups of
  their own, so nothing else would stop them. The launcher names itself in
  `MILLSTREAM_PARENT_PID`; `watch_parent` notices when that process is gone and stops the role
  the same way, then kills what is left after a grace period.
- **Children of a role** that its own shutdown missed: `reap_children` at exit sends SIGTERM,
  then SIGKILL, to every descendant still alive, found from /proc (Linux; elsewhere psutil if
  installed). Where there is no /proc, a zombie launcher counts as alive until reaped, and
  `run_processes` finds nothing: the tests that count processes are Linux-only.

The local launcher's stop (`stop_groups`, shared/process/supervisor.py) counts a role as stopped
when its whole process group is gone, not when the role is: vLLM's EngineCore goes on shutting
down for a while after its actor has exited, and is given the same grace.

Every process of a run also carries `MILLSTREAM_RUN` (the run directory) in its environment,
inherited by whatever it spawns, and every role runs in a process group of its own (a role on a
Ray node: a session of its own), so a test or an operator can find them all (`run_processes`),
even the ones that overwrote their environment.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import anyio

__all__ = [
    "ENV_PARENT",
    "ENV_RUN",
    "start_again_with",
    "stop_on_signals",
    "run_until_signal",
    "watch_parent",
    "descendants",
    "reap_children",
    "run_processes",
    "group_processes",
    "session_processes",
    "stop_groups",
    "live_group",
    "signal_group",
]

log = logging.getLogger(__name__)

#: The launcher's pid; a role whose parent is no longer this process stops.
ENV_PARENT = "MILLSTREAM_PARENT_PID"
#: The run directory, inherited by every process of a run (vLLM's children too).
ENV_RUN = "MILLSTREAM_RUN"

_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
#: Where Linux shows its processes (absent on macOS; see `stop_groups`).
_PROC = Path("/proc")
T = TypeVar("T")


def start_again_with(changes: Mapping[str, str]) -> None:
    """Replace this process by itself run again (same pid, same arguments) with `changes` in
    its environment; nothing when there are none. For what a library reads once, when it loads
    (a preloaded allocator, OpenMP's settings): call it before the role's work starts, since
    nothing done before it survives."""
    if not changes:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], {**os.environ, **changes})


def stop_on_signals() -> None:
    """Synchronous roles: SIGTERM raises KeyboardInterrupt, like Ctrl-C, so `finally` blocks run."""
    signal.signal(signal.SIGTERM, signal.default_int_handler)


async def run_until_signal(
    fn: Callable[..., Awaitable[T]],
    *args: Any,
    drain: Callable[[], Awaitable[Any]] | None = None,
) -> tuple[T | None, int | None]:
    """Async roles: run `fn(*args)`, cancelled at the first SIGTERM or SIGINT.

    Returns `(result, None)` when `fn` returned, `(None, signal number)` when a signal stopped it.
    The signal is received inside the event loop (anyio's signal receiver works under trio and
    asyncio alike), so cancellation unwinds every task and its `finally` blocks. With `drain`,
    the first signal runs `drain()` (while `fn` goes on) before cancelling: an actor replica
    finishes its live requests there; a second signal cancels at once.
    """
    result: list[T] = []
    stopped: list[int] = []

    async def body(scope: anyio.CancelScope) -> None:
        result.append(await fn(*args))
        scope.cancel()

    async def watch(scope: anyio.CancelScope) -> None:
        with anyio.open_signal_receiver(*_STOP_SIGNALS) as signals:
            async for signum in signals:
                log.warning("%s: stopping", signal.Signals(signum).name)
                stopped.append(signum)
                if drain is not None and len(stopped) == 1:
                    async with anyio.create_task_group() as draining:
                        draining.start_soon(_cancel_on_signal, signals, draining.cancel_scope)
                        await drain()
                        draining.cancel_scope.cancel()
                scope.cancel()
                return

    async with anyio.create_task_group() as tg:
        tg.start_soon(watch, tg.cancel_scope)
        tg.start_soon(body, tg.cancel_scope)
    return (result[0] if result else None), (stopped[0] if stopped else None)


async def _cancel_on_signal(signals: Any, scope: anyio.CancelScope) -> None:
    async for signum in signals:
        log.warning("%s again: stopping without draining", signal.Signals(signum).name)
        scope.cancel()
        return


def watch_parent(
    *, every_s: float = 0.5, grace_s: float = 20.0, on_orphan: Callable[[], Any] | None = None
) -> threading.Thread | None:
    """Stop this process when the launcher that started it is gone; None if none started it.

    On orphaning, `on_orphan` runs (default: SIGTERM to ourselves, the orderly path above); if
    the process still lives `grace_s` later, every descendant and the process itself are killed.
    """
    expected = os.environ.get(ENV_PARENT)
    if not expected:
        return None
    parent = int(expected)

    def watch() -> None:
        # The launcher is an ancestor, not always the parent (torchrun sits between it and the
        # learner's ranks), so watch the process itself; a killed launcher not yet reaped by its
        # own parent is a zombie, which counts as gone.
        while _alive(parent):
            time.sleep(every_s)
        log.error("the launcher (pid %d) is gone: stopping", parent)
        (on_orphan or (lambda: os.kill(os.getpid(), signal.SIGTERM)))()
        time.sleep(grace_s)
        reap_children(grace_s=0)
        os.kill(os.getpid(), signal.SIGKILL)

    thread = threading.Thread(target=watch, name="millstream-parent-watch", daemon=True)
    thread.start()
    return thread


def descendants(pid: int | None = None) -> list[int]:
    """Every live descendant of `pid` (default: this process), children before grandchildren."""
    root = os.getpid() if pid is None else pid
    children: dict[int, list[int]] = {}
    for entry, ppid in _parents():
        children.setdefault(ppid, []).append(entry)
    out: list[int] = []
    todo = [root]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _parents() -> list[tuple[int, int]]:
    """(pid, parent pid) of every process."""
    proc = Path("/proc")
    if proc.is_dir():
        pairs = []
        for entry in proc.iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue  # exited meanwhile
            # The command name (field 2) may hold spaces and parentheses: split after the last ')'.
            fields = stat[stat.rfind(")") + 2 :].split()
            pairs.append((int(entry.name), int(fields[1])))
        return pairs
    try:
        import psutil  # type: ignore[import-untyped]
    except ImportError:
        return []
    return [(p.pid, p.ppid()) for p in psutil.process_iter()]


def reap_children(grace_s: float = 5.0) -> list[int]:
    """SIGTERM every descendant, wait up to `grace_s`, SIGKILL the rest; returns who was found."""
    found = descendants()
    for pid in found:
        _kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(_alive(pid) for pid in found):
        time.sleep(0.05)
    for pid in descendants() + found:
        _kill(pid, signal.SIGKILL)
    if found:
        log.info("stopped %d leftover child process(es)", len(found))
    return found


def run_processes(run_dir: str | Path) -> list[int]:
    """Pids of live processes of the run in `run_dir`: those whose environment carries its
    marker, and those in the process group or the session of a role it started (`<name>.pid`
    files: the launcher's roles lead a group, a role on a Ray node leads a session).

    Both are needed: a process that sets its title (vLLM's EngineCore and Worker do, through
    setproctitle) overwrites the memory /proc shows as its environment, but it stays in the
    group and session of the role that started it, re-parented or not.
    """
    run_dir = Path(run_dir).resolve()
    marker = f"{ENV_RUN}={run_dir}".encode() + b"\0"
    roles = set()
    for pid_file in run_dir.glob("*.pid"):
        try:
            pid = int(pid_file.read_text())
        except (OSError, ValueError):
            continue
        # A live pid without the run's marker is not the role any more (its number was reused,
        # or the file names another process): its group and session are someone else's. A dead
        # role's number is not reused while its group or session has members.
        if not _alive(pid) or _marked(pid, marker):
            roles.add(pid)
    return [
        pid
        for pid in _all_pids()
        if _alive(pid) and (_marked(pid, marker) or not roles.isdisjoint(_group_and_session(pid)))
    ]


def group_processes(pgid: int) -> list[int]:
    """Pids of live processes in process group `pgid` (a role started as a group's leader)."""
    return _members(0, pgid)


def stop_groups(pgids: Iterable[int], grace_s: float) -> list[int]:
    """Stop every process of the groups `pgids`; return once none is alive (or what still is).

    SIGCONT and SIGTERM to each group (a stopped process would hold SIGTERM pending), one shared
    wait of `grace_s` for all of them to be empty, SIGKILL to the groups with anyone left, and a
    last wait of up to 10 s for the kernel to take them. `grace_s=0` kills at once. A group is
    empty when its last member is gone, not when its leader is: a role's children (vLLM's
    EngineCore and Worker, torchrun's ranks) outlive their leader by seconds, and whoever starts
    the next engine or says "every process stopped" must not count them as gone. A zombie counts
    as gone (its parent reaps it). Returns the pids still alive after all that: empty unless a
    process is stuck in the kernel (a GPU driver, a hung mount), which no signal ends.

    Pass only groups that are still this caller's: the pid of a leader already reaped names
    nobody once its group is empty, and the kernel may give the number to a new process (see
    `live_group`). Without /proc (macOS) members cannot be told from zombies: a group counts as
    alive while `killpg(pgid, 0)` reaches anyone, every group still reached after the grace is
    SIGKILLed, and nothing is waited for after that.
    """
    groups = set(pgids)
    if grace_s > 0:
        for sig in (signal.SIGCONT, signal.SIGTERM):
            for pgid in groups:
                signal_group(pgid, sig)
    left = _wait_groups_gone(groups, grace_s)
    if not left:
        return []
    for pgid in set(left.values()):
        signal_group(pgid, signal.SIGKILL)
    if not _PROC.is_dir():
        return []  # nothing can tell a killed process from a zombie here
    return sorted(_wait_groups_gone(groups, 10.0))


def live_group(pid: int, returncode: int | None) -> bool:
    """Is `pid`'s group still one to stop? Yes while its leader is not reaped (`returncode` is
    None), and after that while members are left: Linux does not give a number to a new
    process while a group of that number has members, so they are the leader's."""
    return returncode is None or bool(group_processes(pid))


def _wait_groups_gone(pgids: set[int], timeout_s: float) -> dict[int, int]:
    """{pid: group} of the live members of `pgids` after waiting up to `timeout_s` for none."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = _live_members(pgids)
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.1)


def _live_members(pgids: set[int]) -> dict[int, int]:
    """{pid: group} of the live processes in `pgids` (one read of /proc/<pid>/stat each); without
    /proc, {pgid: pgid} for each group that a signal still reaches."""
    if not _PROC.is_dir():
        return {pgid: pgid for pgid in pgids if _group_reached(pgid)}
    left = {}
    for pid in _all_pids():
        fields = _stat_fields(pid)
        if fields and int(fields[2]) in pgids and fields[0] != "Z":
            left[pid] = int(fields[2])
    return left


def _group_reached(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def session_processes(sid: int) -> list[int]:
    """Pids of live processes in session `sid` (a role started with its own session)."""
    return _members(1, sid)


def _members(field: int, ident: int) -> list[int]:
    """Live pids whose (group, session)[field] is `ident`."""
    return [pid for pid in _all_pids() if _group_and_session(pid)[field:][:1] == (ident,) and _alive(pid)]


def _all_pids() -> list[int]:
    if not _PROC.is_dir():
        return []  # read from /proc (Linux only)
    return [int(entry.name) for entry in _PROC.iterdir() if entry.name.isdigit()]


def _stat_fields(pid: int) -> list[str]:
    """/proc/<pid>/stat after the command name: state, ppid, pgrp, session, ...; [] if gone."""
    try:
        stat = (_PROC / str(pid) / "stat").read_text()
    except OSError:
        return []
    return stat[stat.rfind(")") + 2 :].split()


def _marked(pid: int, marker: bytes) -> bool:
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return False
    return environ.startswith(marker) or b"\0" + marker in environ


def _group_and_session(pid: int) -> tuple[int, ...]:
    """(process group, session) of `pid`; () if it is gone."""
    fields = _stat_fields(pid)  # state, ppid, pgrp, session
    return (int(fields[2]), int(fields[3])) if fields else ()


def _alive(pid: int) -> bool:
    """Running (a zombie, dead but not yet waited for, counts as gone where /proc tells)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        if Path("/proc/self/stat").exists():
            return False
        try:  # no /proc (macOS): existence is all we can tell
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True
    except ProcessLookupError:  # reaped between the open and the read
        return False
    except OSError:
        return True
    return not stat[stat.rfind(")") + 2 :].startswith("Z")


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def signal_group(pgid: int, sig: int) -> None:
    """`sig` to process group `pgid`; nothing if it is gone or not ours."""
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass
