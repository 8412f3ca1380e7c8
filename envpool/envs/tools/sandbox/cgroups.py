"""One cgroup per sandboxed call: all its processes together under one memory, process and CPU ceiling.

RLIMIT_AS bounds each process of a call, not the call: code that forks holds the limit once per
child (measured before this existed: one call at 1,330 MiB across 17 processes under a 256 MiB
limit). A cgroup counts them together, the tmpfs working directory's files included, and the
kernel enforces it: past `memory`, it kills a process of that call (the call reports
`memory_limit`); past `processes`, fork fails with EAGAIN; past `cpus`, the call is throttled.

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
_FOUND: dict[str, CallCgroups | str] = {}


@dataclass(frozen=True)
class Ceiling:
    """What one call's processes may use together."""

    memory_bytes: int
    processes: int
    cpus: float


@dataclass(frozen=True)
class Usage:
    """What one call used, read from its cgroup before it is removed."""

    memory_peak_bytes: int | None  #: None where the kernel keeps no peak (v2 before Linux 5.19)
    oom_kills: int  #: processes the kernel killed for the memory ceiling
    forks_refused: int  #: forks refused at the process ceiling
    throttled: int  #: CPU periods in which the call was held back


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
        peak_name = "memory.peak" if self.version == 2 else "memory.max_usage_in_bytes"
        oom_name = "memory.events" if self.version == 2 else "memory.oom_control"
        peak = _read_int(self._file("memory", peak_name))
        return Usage(
            memory_peak_bytes=peak,
            oom_kills=_keyed(self._file("memory", oom_name), "oom_kill"),
            forks_refused=_keyed(self._file("pids", "pids.events"), "max"),
            throttled=_keyed(self._file("cpu", "cpu.stat"), "nr_throttled"),
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
            _write(folder / "pids.max", ceiling.processes)
            if "cpu" in call.dirs:
                _write(folder / "cpu.max", f"{quota} {_CPU_PERIOD_US}")
            return
        memory = call.dirs["memory"]
        _write(memory / "memory.limit_in_bytes", ceiling.memory_bytes)
        if (memory / "memory.memsw.limit_in_bytes").exists():  # swap accounting is on
            _write(memory / "memory.memsw.limit_in_bytes", ceiling.memory_bytes)
        _write(call.dirs["pids"] / "pids.max", ceiling.processes)
        if "cpu" in call.dirs:
            _write(call.dirs["cpu"] / "cpu.cfs_period_us", _CPU_PERIOD_US)
            _write(call.dirs["cpu"] / "cpu.cfs_quota_us", quota)


def find_cgroups(setting: str) -> CallCgroups | str:
    """This process's place for per-call cgroups under `setting` ("auto", "off" or a v2
    directory), or why there is none (one line). Found once per process and setting."""
    if setting not in _FOUND:
        _FOUND[setting] = _find(setting)
    return _FOUND[setting]


def _find(setting: str) -> CallCgroups | str:
    if setting == "off":
        return "cgroup = 'off'"
    if setting != "auto":
        base = Path(setting)
        if not (base / "cgroup.controllers").is_file():
            return f"cgroup = {setting!r} is not a cgroup v2 directory"
        return _v2_under(base, enable_at_base=True)
    mount, own = _v2_place()
    reasons = []
    if mount is not None and own is not None:
        found = _v2_under(mount / own.lstrip("/"), enable_at_base=True)
        if isinstance(found, CallCgroups):
            return found
        reasons.append(found)
    else:
        reasons.append("cgroup v2: no unified hierarchy for this process")
    found = _v1()
    if isinstance(found, CallCgroups):
        return found
    return "; ".join(reasons + [found])


def _v2_under(base: Path, enable_at_base: bool) -> CallCgroups | str:
    """Calls under base/millstream-sandbox-<pid>/, with memory and pids (and cpu) enabled."""
    available = set(_read_text(base / "cgroup.controllers").split())
    missing = [c for c in _NEEDED if c not in available]
    if missing:
        return f"cgroup v2 at {base}: no {' or '.join(missing)} controller"
    wanted = [c for c in (*_NEEDED, "cpu") if c in available]
    enable = " ".join(f"+{c}" for c in wanted)
    _sweep(base)
    ours = base / f"{_PREFIX}{os.getpid()}"
    try:
        if enable_at_base and not set(wanted) <= set(_read_text(base / "cgroup.subtree_control").split()):
            (base / "cgroup.subtree_control").write_text(enable)
        ours.mkdir(exist_ok=True)
        (ours / "cgroup.subtree_control").write_text(enable)
    except OSError as exc:
        _rmdir(ours)
        return f"cgroup v2 at {base}: cannot enable {enable} for its children ({exc.strerror})"
    atexit.register(_rmdir, ours)
    parents = {c: ours for c in wanted}
    return CallCgroups(2, parents, f"cgroup v2 at {ours}")


def _v1() -> CallCgroups | str:
    """Calls under <each v1 controller's own cgroup>/millstream-sandbox-<pid>/."""
    mounts = _v1_mounts()
    own = _own_paths()
    parents: dict[str, Path] = {}
    for controller in _V1_CONTROLLERS:
        if controller not in mounts or controller not in own:
            if controller in _NEEDED:
                return f"cgroup v1: no {controller} hierarchy"
            continue
        mount_point, mount_root = mounts[controller]
        relative = os.path.relpath(own[controller], mount_root)
        base = (mount_point / relative).resolve()
        _sweep(base)
        ours = base / f"{_PREFIX}{os.getpid()}"
        try:
            ours.mkdir(exist_ok=True)
        except OSError as exc:
            for made in parents.values():
                _rmdir(made)
            if controller in _NEEDED:
                return f"cgroup v1: cannot make a {controller} cgroup under {base} ({exc.strerror})"
            continue
        atexit.register(_rmdir, ours)
        parents[controller] = ours
    return CallCgroups(1, parents, "cgroup v1 (" + ", ".join(sorted(parents)) + ")")


def _v2_place() -> tuple[Path | None, str | None]:
    mount = next((point for fstype, _, point, _ in _mountinfo() if fstype == "cgroup2"), None)
    own = next((path for hid, _, path in _proc_cgroup() if hid == "0"), None)
    return mount, own


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
