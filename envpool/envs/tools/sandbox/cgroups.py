"""One cgroup per sandboxed call: all its processes together under one memory, process and CPU ceiling.

RLIMIT_AS bounds each process of a call, not the call: code that forks holds the limit once per
child (measured before this existed: one call at 1,330 MiB across 17 processes under a 256 MiB
limit). A cgroup counts them together, the tmpfs working directory's files included, and the
kernel enforces it: past `memory`, it kills a process of that call (the call reports
`memory_limit`); past `processes` (processes and threads together, as the kernel counts them),
fork and thread creation fail with EAGAIN; past `cpus`, the call is throttled.

Where the cgroups go (`find_cgroups`, once per process and setting):
- "auto": the unified hierarchy (cgroup v2) under this process's own cgroup, when memory and
  pids can be enabled for its children there; else the v1 memory, pids and cpu hierarchies
  (a v1 or hybrid host, this project's VM among them) under this process's own cgroup in each;
  else none, and `find_cgroups` says why in one line (pytool logs it at preflight and runs on, each
  process still held to its rlimits).
- a path: a cgroup v2 directory delegated to this user (`systemd-run --user -p Delegate=yes`,
  or a container's own cgroup): used as is, or refused with the reason.
- "off": none.

Under the chosen place, this process makes `millstream-sandbox-<pid>/` and one `call-<n>/` per
call. The sandbox's child joins its call's cgroup itself, before it forks or reads the code, so
nothing it starts escapes it. After the call its cgroup is emptied (killed) and removed;
a process killed before it could clean up leaves an empty folder that the next `find_cgroups` on
the machine removes.
"""

from __future__ import annotations

import atexit
import itertools
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CallCgroup", "CallCgroups", "Ceiling", "Usage", "find_cgroups"]

_V1_CONTROLLERS = ("memory", "pids", "cpu")
_NEEDED = ("memory", "pids")  # cpu is optional: a call without it is only not throttled
_PREFIX = "millstream-sandbox-"
_CPU_PERIOD_US = 100_000
#: The jail's own supervisor and init, counted by pids.max but not the code's to spend.
JAIL_TASKS = 2
_FOUND: dict[tuple[int, str], CallCgroups | str] = {}


@dataclass(frozen=True)
class Ceiling:
    """What one call's processes may use together."""

    memory_bytes: int
    processes: int  #: processes and threads the code may run at once (pids counts both)
    cpus: float


@dataclass(frozen=True)
class Usage:
    """What one call used, read from its cgroup before it is removed."""

    memory_peak_bytes: int | None  #: None where the kernel keeps no peak (v2 before Linux 5.19)
    oom_kills: int  #: processes of the call the kernel killed for want of memory
    #: the call reached its memory ceiling (so the kills were the ceiling's, not the host's)
    at_ceiling: bool


class CallCgroup:
    """One call's cgroup (one folder on v2, one per controller on v1)."""

    def __init__(self, version: int, dirs: dict[str, Path]) -> None:
        self.version, self.dirs = version, dirs

    @property
    def join_files(self) -> list[str]:
        """The cgroup.procs files the child writes its pid into."""
        return [str(d / "cgroup.procs") for d in dict.fromkeys(self.dirs.values())]

    def _file(self, controller: str, name: str) -> Path | None:
        folder = self.dirs.get(controller)
        return None if folder is None else folder / name

    def usage(self) -> Usage:
        if self.version == 2:
            events = self._file("memory", "memory.events")
            return Usage(
                memory_peak_bytes=_read_int(self._file("memory", "memory.peak")),
                oom_kills=_keyed(events, "oom_kill"),
                at_ceiling=_keyed(events, "oom") > 0,
            )
        peak = _read_int(self._file("memory", "memory.max_usage_in_bytes"))
        limit = _read_int(self._file("memory", "memory.limit_in_bytes"))
        return Usage(
            memory_peak_bytes=peak,
            oom_kills=_keyed(self._file("memory", "memory.oom_control"), "oom_kill"),
            # v1's failcnt stays 0 on recent kernels: the peak touching the limit says it
            at_ceiling=peak is not None and limit is not None and peak >= limit,
        )

    def remove(self, timeout_s: float = 5.0) -> bool:
        """Kill what is left in the call's cgroup and remove it; False if it would not go.

        Normally nothing is left: the jail's PID namespace died with the call. After a timeout
        the namespace's init is dying as this runs, so this waits (polls) for it."""
        deadline = time.monotonic() + timeout_s
        for folder in dict.fromkeys(self.dirs.values()):
            while True:
                _kill_members(folder)
                try:
                    folder.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:  # EBUSY: processes are still exiting
                    if time.monotonic() > deadline:
                        return False
                    time.sleep(0.01)
        return True


class CallCgroups:
    """Where this process makes its calls' cgroups (see the module docstring)."""

    def __init__(self, version: int, parents: dict[str, Path], where: str) -> None:
        self.version, self.parents, self.where = version, parents, where
        self._numbers = itertools.count()

    def open(self, ceiling: Ceiling) -> CallCgroup:
        """Make one call's cgroup with `ceiling` written into it (OSError if the kernel refuses)."""
        name = f"call-{next(self._numbers)}"
        dirs = {controller: parent / name for controller, parent in self.parents.items()}
        call = CallCgroup(self.version, dirs)
        try:
            for folder in dict.fromkeys(dirs.values()):
                folder.mkdir()
            self._limit(call, ceiling)
        except OSError:
            call.remove(timeout_s=0)
            raise
        return call

    def _limit(self, call: CallCgroup, ceiling: Ceiling) -> None:
        quota = max(1000, int(ceiling.cpus * _CPU_PERIOD_US))
        if self.version == 2:
            folder = call.dirs["memory"]
            _write(folder / "memory.max", ceiling.memory_bytes)
            if (folder / "memory.swap.max").exists():
                _write(folder / "memory.swap.max", 0)  # swap would let the call past its ceiling
            _write(folder / "pids.max", ceiling.processes + JAIL_TASKS)
            if "cpu" in call.dirs:
                _write(folder / "cpu.max", f"{quota} {_CPU_PERIOD_US}")
            return
        memory = call.dirs["memory"]
        _write(memory / "memory.limit_in_bytes", ceiling.memory_bytes)
        if (memory / "memory.memsw.limit_in_bytes").exists():  # swap accounting is on
            _write(memory / "memory.memsw.limit_in_bytes", ceiling.memory_bytes)
        elif (memory / "memory.swappiness").exists():  # else swap would let it past the ceiling
            _write(memory / "memory.swappiness", 0)
        _write(call.dirs["pids"] / "pids.max", ceiling.processes + JAIL_TASKS)
        if "cpu" in call.dirs:
            _write(call.dirs["cpu"] / "cpu.cfs_period_us", _CPU_PERIOD_US)
            _write(call.dirs["cpu"] / "cpu.cfs_quota_us", quota)


def find_cgroups(setting: str) -> CallCgroups | str:
    """This process's place for per-call cgroups under `setting` ("auto", "off" or a v2
    directory), or why there is none (one line). Found once per process and setting: a trial
    call cgroup is made, limited and removed, so a half-usable hierarchy is a reason here, not
    a failed setup at every call."""
    key = (os.getpid(), setting)  # a forked child finds its own (its calls' names are its own)
    if key not in _FOUND:
        found = _find(setting)
        if isinstance(found, CallCgroups):
            found = _tried(found)
        _FOUND[key] = found
    return _FOUND[key]


def _tried(found: CallCgroups) -> CallCgroups | str:
    try:
        call = found.open(Ceiling(64 * 2**20, 8, 1.0))
    except OSError as exc:
        return f"{found.where}: a call's cgroup cannot be made and limited ({exc})"
    if not call.remove(timeout_s=1.0):
        return f"{found.where}: a call's cgroup cannot be removed"
    return found


def _find(setting: str) -> CallCgroups | str:
    if setting == "off":
        return "cgroup = 'off'"
    if setting != "auto":
        base = Path(setting)
        if not (base / "cgroup.controllers").is_file():
            return f"cgroup = {setting!r} is not a cgroup v2 directory"
        if _read_text(base / "cgroup.procs").split():
            return (
                f"cgroup = {setting!r} holds processes, so it cannot give memory and pids to "
                "children of its own (cgroup v2's no-internal-process rule); name an empty one"
            )
        return _v2_under(base)
    reasons = []
    own = _v2_own()
    if own is not None:
        found = _v2_under(own)
        if isinstance(found, CallCgroups):
            return found
        reasons.append(found)
    else:
        reasons.append("cgroup v2: no unified hierarchy for this process")
    found = _v1()
    if isinstance(found, CallCgroups):
        return found
    return "; ".join(reasons + [found])


def _v2_under(base: Path) -> CallCgroups | str:
    """Calls under base/millstream-sandbox-<pid>/, with memory and pids (and cpu if it can be
    had) enabled for them.

    The kernel lets a cgroup other than the root give memory or pids to its children only when
    it holds no process itself: so "auto" works for a process in the root cgroup (a VM, a
    container sharing the host's cgroups as root), and elsewhere a delegated empty cgroup must
    be named (docs/environments.md shows how)."""
    available = set(_read_text(base / "cgroup.controllers").split())
    missing = [c for c in _NEEDED if c not in available]
    if missing:
        return f"cgroup v2 at {base}: no {' or '.join(missing)} controller"
    _sweep(base)
    ours = _own_folder(base)
    problem = ""
    for wanted in ([*_NEEDED, "cpu"], list(_NEEDED)):  # cpu is optional: without it, no throttle
        if not set(wanted) <= available:
            continue
        enable = " ".join(f"+{c}" for c in wanted)
        try:
            if not set(wanted) <= set(_read_text(base / "cgroup.subtree_control").split()):
                (base / "cgroup.subtree_control").write_text(enable)
            ours.mkdir(exist_ok=True)
            (ours / "cgroup.subtree_control").write_text(enable)
        except OSError as exc:
            _rmdir(ours)
            busy = "; processes live in it: name an empty delegated cgroup" if exc.errno == 16 else ""
            problem = (
                problem or f"cgroup v2 at {base}: cannot give {enable} to its children ({exc.strerror}{busy})"
            )
            continue
        atexit.register(_rmdir, ours)
        return CallCgroups(2, {c: ours for c in wanted}, f"cgroup v2 at {ours}")
    return problem


def _v1() -> CallCgroups | str:
    """Calls under <each v1 controller's own cgroup>/millstream-sandbox-<pid>/."""
    mounts = _v1_mounts()
    own = _own_paths()
    parents: dict[str, Path] = {}
    for controller in _V1_CONTROLLERS:
        if controller not in mounts or controller not in own:
            if controller in _NEEDED:
                _remove_all(parents)
                return f"cgroup v1: no {controller} hierarchy"
            continue
        mount_point, mount_root = mounts[controller]
        base = (mount_point / os.path.relpath(own[controller], mount_root)).resolve()
        _sweep(base)
        ours = _own_folder(base)
        try:
            ours.mkdir(exist_ok=True)
        except OSError as exc:
            if controller in _NEEDED:
                _remove_all(parents)
                return f"cgroup v1: cannot make a {controller} cgroup under {base} ({exc.strerror})"
            continue  # cpu: the call is only not throttled
        atexit.register(_rmdir, ours)
        parents[controller] = ours
    return CallCgroups(1, parents, "cgroup v1 (" + ", ".join(sorted(parents)) + ")")


def _remove_all(parents: dict[str, Path]) -> None:
    for made in parents.values():
        _rmdir(made)


def _own_folder(base: Path) -> Path:
    """base/millstream-sandbox-<pid>, emptied of calls a dead process of the same pid left."""
    ours = base / f"{_PREFIX}{os.getpid()}"
    for call in ours.glob("call-*"):
        _kill_members(call)
        _rmdir(call)
    return ours


def _v2_own() -> Path | None:
    """This process's own cgroup in the unified hierarchy, as a folder, or None."""
    mount = next(((point, root) for fstype, root, point, _ in _mountinfo() if fstype == "cgroup2"), None)
    own = next((path for hid, _, path in _proc_cgroup() if hid == "0"), None)
    if mount is None or own is None:
        return None
    point, root = mount
    return (point / os.path.relpath(own, root)).resolve()


def _v1_mounts() -> dict[str, tuple[Path, str]]:
    found: dict[str, tuple[Path, str]] = {}
    for fstype, root, point, options in _mountinfo():
        if fstype == "cgroup":
            for controller in _V1_CONTROLLERS:
                if controller in options.split(","):
                    found.setdefault(controller, (point, root))
    return found


def _own_paths() -> dict[str, str]:
    return {c: path for _, names, path in _proc_cgroup() for c in names.split(",") if c}


def _mountinfo() -> list[tuple[str, str, Path, str]]:
    """(fstype, root within the filesystem, mount point, super options) per mount."""
    found = []
    for line in _read_text(Path("/proc/self/mountinfo")).splitlines():
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if len(fields) >= 5 and len(tail) >= 3:
            found.append((tail[0], fields[3], Path(fields[4]), tail[2]))
    return found


def _proc_cgroup() -> list[tuple[str, str, str]]:
    lines = _read_text(Path("/proc/self/cgroup")).splitlines()
    return [tuple(line.split(":", 2)) for line in lines if line.count(":") >= 2]  # type: ignore[misc]


def _sweep(base: Path) -> None:
    """Remove the (empty) folders left by processes killed before they could clean up."""
    try:
        leftovers = [p for p in base.iterdir() if p.name.startswith(_PREFIX)]
    except OSError:
        return
    for folder in leftovers:
        pid = folder.name[len(_PREFIX) :]
        if pid.isdigit() and int(pid) != os.getpid() and not Path(f"/proc/{pid}").exists():
            for call in folder.glob("call-*"):
                _kill_members(call)
                _rmdir(call)
            _rmdir(folder)


def _kill_members(folder: Path) -> None:
    if (folder / "cgroup.kill").exists():
        try:
            (folder / "cgroup.kill").write_text("1")
            return
        except OSError:
            pass
    for pid in _read_text(folder / "cgroup.procs").split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _rmdir(folder: Path) -> None:
    try:
        folder.rmdir()
    except OSError:
        pass


def _write(path: Path, value: object) -> None:
    path.write_text(str(value))


def _read_text(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _read_int(path: Path | None) -> int | None:
    text = _read_text(path).strip() if path is not None else ""
    return int(text) if text.isdigit() else None


def _keyed(path: Path | None, key: str) -> int:
    """The value of `key` in a flat keyed file ("name value" lines), 0 if absent."""
    for line in _read_text(path).splitlines() if path is not None else ():
        name, _, value = line.partition(" ")
        if name == key and value.strip().isdigit():
            return int(value)
    return 0
