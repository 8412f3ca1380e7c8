"""CPU time of processes, read from Linux's /proc: one place for the benchmarks that count it.

`cpu_s(pid)` is one process's user + system seconds (bench/fleet.py, per replica);
`tree_cpu_s(root)` sums a process and everything under it (bench/overhead.py: the engines, their
engine cores and workers), whatever started them, by walking parent pids; `tree_rss_bytes(root)`
is the same walk for resident memory (bench/learning/real_model.py: each role's peak, engine included),
`tree_fds(root)` for open file descriptors (bench/soak), `tree_pss_bytes(root)` for proportional
memory (bench/soak: forked processes share pages, which RSS counts once per process), and
`tree_pss_by_name(root)` the same split by process name (which of the actor's processes grows).
`tree_thread_cpu_s(root)` splits the tree's CPU by process and thread name (bench/overhead.py:
which thread of which process pays the hop), as `top -H` would, from /proc/PID/task;
`tree_thread_wait_s(root)` is the same split of the time threads were runnable and waited for a
core (the scheduler's run-queue wait, /proc/PID/task/TID/schedstat): on a box whose VM has no
hardware counters for `perf`, the one number that says a thread was kept from running.
`labelled_threads(roots, per_process)` joins such splits for several trees and this process.
`CpuMeter` is CPU per unit of work between two moments (bench/stress.py: microseconds of each
process per turn, which is what bounds turns/s on a box of few cores).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from millstream.envpool.stats import rss_bytes

__all__ = [
    "CpuMeter",
    "cpu_s",
    "tree_cpu_s",
    "tree_fds",
    "thread_cpu_s",
    "tree_pss_by_name",
    "tree_pss_bytes",
    "tree_rss_bytes",
    "tree_thread_cpu_s",
    "tree_thread_wait_s",
    "thread_wait_s",
    "labelled_threads",
]

CLK_TCK = os.sysconf("SC_CLK_TCK")


def _stat(pid: int) -> tuple[int, float]:
    """(parent pid, user + system CPU seconds) of `pid`."""
    return _stat_file(Path(f"/proc/{pid}/stat"))


def _stat_file(path: Path) -> tuple[int, float]:
    """(parent pid, user + system CPU seconds) from a process's or a thread's `stat` file."""
    fields = path.read_text().rsplit(")", 1)[1].split()  # the name may hold spaces and ")"
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / CLK_TCK


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process."""
    return _stat(pid)[1]


def tree_cpu_s(root: int) -> float:
    """CPU seconds used so far by `root` and every process under it."""
    return sum(_cpu(pid) for pid in _tree(root))


def tree_thread_cpu_s(root: int) -> dict[str, float]:
    """CPU seconds used so far under `root`, summed by "process name/thread name".

    Names are the kernel's (`comm`, 15 characters): vLLM names its processes (`VLLM::EngineCor`,
    `VLLM::Worker`), Python threads keep their process's name unless they set one, and OpenMP's
    threads share their process's. Threads that ended are gone from the sum: compare two
    readings of long-lived threads only."""
    return _tree_by_thread(root, thread_cpu_s)


def tree_thread_wait_s(root: int) -> dict[str, float]:
    """Seconds the threads under `root` waited runnable for a core so far, by the same names."""
    return _tree_by_thread(root, thread_wait_s)


def thread_cpu_s(pid: int) -> dict[str, float]:
    """One process's CPU seconds so far, summed by "process name/thread name" (empty once ended)."""
    return _by_thread(pid, lambda task: _stat_file(task / "stat")[1])


def thread_wait_s(pid: int) -> dict[str, float]:
    """One process's run-queue wait so far, in seconds, summed by "process name/thread name"."""
    return _by_thread(pid, lambda task: int((task / "schedstat").read_text().split()[1]) / 1e9)


PerThread = Callable[[int], dict[str, float]]


def labelled_threads(roots: dict[str, int], per_process: PerThread) -> dict[str, float]:
    """`per_process` (`thread_cpu_s` or `thread_wait_s`) of this process's threads, as
    "bench:process/thread", and of each tree in `roots`, as "LABEL:process/thread"."""
    split = {f"bench:{k}": v for k, v in per_process(os.getpid()).items()}
    for label, root in roots.items():
        split.update({f"{label}:{k}": v for k, v in _tree_by_thread(root, per_process).items()})
    return split


def _tree_by_thread(root: int, per_process: PerThread) -> dict[str, float]:
    totals: dict[str, float] = {}
    for pid in _tree(root):
        for key, seconds in per_process(pid).items():
            totals[key] = totals.get(key, 0.0) + seconds
    return totals


def _by_thread(pid: int, read: Callable[[Path], float]) -> dict[str, float]:
    """`read(/proc/PID/task/TID)` of each thread of `pid`, summed by "process name/thread name"."""
    totals: dict[str, float] = {}
    try:
        process = Path(f"/proc/{pid}/comm").read_text().strip()
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:  # ended meanwhile
        return totals
    for tid in tids:
        try:
            task = Path(f"/proc/{pid}/task/{tid}")
            thread = (task / "comm").read_text().strip()
            seconds = read(task)
        except (OSError, IndexError, ValueError):
            continue
        key = f"{process}/{thread}"
        totals[key] = totals.get(key, 0.0) + seconds
    return totals


def tree_rss_bytes(root: int) -> int:
    """Resident memory of `root` and every process under it, in bytes (0 once it has ended)."""
    return sum(_rss(pid) for pid in _tree(root))


def tree_pss_bytes(root: int) -> int:
    """Proportional memory of `root` and every process under it, in bytes (0 once it has ended):
    each page shared by n processes counts 1/n to each, so the sum counts it once (RSS summed
    over a vLLM engine's forked EngineCore and Worker counts their shared pages twice)."""
    return sum(_pss(pid) for pid in _tree(root))


def tree_pss_by_name(root: int) -> dict[str, int]:
    """`tree_pss_bytes` split by process name (`/proc/PID/comm`: the actor's own process, vLLM's
    `VLLM::EngineCor` and `VLLM::Worker...`). Processes of one name are told apart by pid order
    (`python#2`; the order of creation unless pids wrapped): vLLM names its processes with
    `setproctitle`, which did not take in one run here (the whole run under `LD_PRELOAD`), and
    then all of them are `python`."""
    names: list[tuple[int, str]] = []
    for pid in sorted(_tree(root)):
        try:
            names.append((pid, Path(f"/proc/{pid}/comm").read_text().strip()))
        except OSError:  # ended meanwhile
            continue
    seen: dict[str, int] = {}
    out: dict[str, int] = {}
    for pid, name in names:
        seen[name] = seen.get(name, 0) + 1
        out[name if seen[name] == 1 else f"{name}#{seen[name]}"] = _pss(pid)
    return out


def tree_fds(root: int) -> int:
    """Open file descriptors of `root` and every process under it (0 once it has ended)."""
    total = 0
    for pid in _tree(root):
        try:
            total += len(os.listdir(f"/proc/{pid}/fd"))
        except OSError:  # ended meanwhile
            continue
    return total


class CpuMeter:
    """CPU seconds of named process trees between a `start` and a `stop`, per unit of work.

    A process started by a measured one (vLLM's engine core under an actor) counts with it,
    except for the names in `alone`: the driver that started the others (`os.getpid()`) counts
    only its own CPU, not its children's.
    """

    def __init__(self, roots: dict[str, int], alone: frozenset[str] = frozenset()) -> None:
        self.roots, self.alone = roots, alone
        self._start: dict[str, float] = {}
        self._work_at_start = 0.0
        self.cpu_s: dict[str, float] = {}
        self.work = 0.0

    @property
    def started(self) -> bool:
        return bool(self._start)

    def start(self, work: float) -> None:
        """The window opens: CPU so far, and how much work is done already."""
        self._start = self._read()
        self._work_at_start = work

    def stop(self, work: float) -> None:
        """The window closes (before the processes end: an ended process reads 0)."""
        if not self._start:
            return
        now = self._read()
        self.cpu_s = {name: now[name] - self._start[name] for name in self.roots}
        self.work = work - self._work_at_start

    def _read(self) -> dict[str, float]:
        return {
            name: _cpu(pid) if name in self.alone else tree_cpu_s(pid) for name, pid in self.roots.items()
        }

    def per_unit_us(self) -> dict[str, float]:
        """Microseconds of CPU per unit of work, by name; empty if no work was measured."""
        if self.work <= 0:
            return {}
        return {name: 1e6 * s / self.work for name, s in self.cpu_s.items()}


def _tree(root: int) -> list[int]:
    """`root` and every process under it now, whatever started them, by walking parent pids."""
    parent: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                parent[int(entry)] = _stat(int(entry))[0]
            except OSError:  # ended meanwhile
                continue
    tree = []
    for pid in parent:
        p = pid
        while p > 1 and p != root:
            p = parent.get(p, 0)
        if p == root:
            tree.append(pid)
    return tree


def _cpu(pid: int) -> float:
    try:
        return _stat(pid)[1]
    except OSError:  # ended meanwhile
        return 0.0


def _pss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:  # ended meanwhile, or no smaps_rollup (kernels before 4.14)
        pass
    return 0


def _rss(pid: int) -> int:
    try:
        return rss_bytes(pid)
    except OSError:  # ended meanwhile
        return 0
