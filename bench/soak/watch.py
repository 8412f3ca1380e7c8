"""What the soak watches: each role's memory and open files over time, and whether they grow.

Memory is sampled two ways: resident (RSS, summed over the tree) and proportional (PSS: a page
shared by n processes counts 1/n to each, so pages a forked EngineCore or Worker shares with the
actor count once).

A role is what the launcher started under one name (`actor`, `learner`, `envpool-0`, ...), found
by its pid file in the run directory each time, so a restarted role (chaos kills them) is the
same series under a new pid. A role's numbers are its whole process tree's: the vLLM engine's
EngineCore and Worker count to the actor, DeepSpeed's helpers to the learner.

Growth is a least-squares slope over the samples after the warm-up (MiB or descriptors per
hour), fitted within each process of the role (each with its own level: a restart's drop back
to the starting size is not counted as shrinking). A process that a kill restarted leaves out
its own first minutes too (`--process-warmup-min`, 2): an engine loading its model and filling
its buffers is not a leak, and with restarts every few minutes it would be most of the slope.
The report gives each role's restarts beside it, and the
last sample against the first after the warm-up.

Each role's PSS is also kept per process name (`parts`): the actor's tree is three processes
(the actor, vLLM's EngineCore and its Worker), and a tree that grows says nothing about which.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from millstream.bench.kit.procstat import tree_fds, tree_pss_by_name, tree_rss_bytes

__all__ = ["Watch", "slope_per_hour"]


@dataclass
class Watch:
    run_dir: Path
    started: float = field(default_factory=time.monotonic)
    #: per role: [(minutes since the start, RSS MiB, open descriptors, pid, PSS MiB)]
    samples: dict[str, list[tuple[float, float, int, int, float]]] = field(default_factory=dict)
    #: per role: [(minutes since the start, pid, {process name: PSS MiB})]
    parts: dict[str, list[tuple[float, int, dict[str, float]]]] = field(default_factory=dict)

    def sample(self) -> None:
        """One sample of every role whose pid file names a live process."""
        minute = (time.monotonic() - self.started) / 60
        for pid_file in sorted(self.run_dir.glob("*.pid")):
            try:
                pid = int(pid_file.read_text())
            except (OSError, ValueError):
                continue
            rss = tree_rss_bytes(pid)
            if rss == 0:  # between a kill and its restart
                continue
            by_name = {name: pss / 2**20 for name, pss in tree_pss_by_name(pid).items()}
            pss = sum(by_name.values())
            self.samples.setdefault(pid_file.stem, []).append((minute, rss / 2**20, tree_fds(pid), pid, pss))
            self.parts.setdefault(pid_file.stem, []).append((minute, pid, by_name))

    def report(
        self, warmup_min: float, restarts: dict[str, int], process_warmup_min: float = 2.0
    ) -> dict[str, Any]:
        """Per role: slopes after the warm-up, first and last sample after it, restarts. A
        process a kill restarted warms up too: its first `process_warmup_min` minutes (from its
        first sample) are left out as the run's first `warmup_min` are."""
        out = {}
        for role, points in self.samples.items():
            warm = _past_warmups(points, warmup_min, process_warmup_min)
            after = [p for p in points if warm(p[0], p[3])]
            if len(after) < 2:
                continue
            out[role] = {
                "samples": len(after),
                "rss_mib_first": round(after[0][1], 1),
                "rss_mib_last": round(after[-1][1], 1),
                "rss_mib_max": round(max(p[1] for p in after), 1),
                "rss_mib_per_hour": round(slope_per_hour([(p[0], p[1], p[3]) for p in after]), 1),
                # PSS counts a page shared by the role's forked processes once (RSS: once each).
                "pss_mib_first": round(after[0][4], 1),
                "pss_mib_last": round(after[-1][4], 1),
                "pss_mib_per_hour": round(slope_per_hour([(p[0], p[4], p[3]) for p in after]), 1),
                "fds_first": after[0][2],
                "fds_last": after[-1][2],
                "fds_per_hour": round(slope_per_hour([(p[0], float(p[2]), p[3]) for p in after]), 1),
                "restarts": restarts.get(role, 0),
                "pss_mib_per_hour_by_process": self._part_slopes(role, warm),
            }
        return out

    def _part_slopes(self, role: str, warm: Callable[[float, int], bool]) -> dict[str, float]:
        """PSS growth per hour of each process name of `role` after the warm-ups."""
        after = [p for p in self.parts.get(role, []) if warm(p[0], p[1])]
        names = sorted({name for _, _, by_name in after for name in by_name})
        return {
            name: round(
                slope_per_hour([(t, by_name[name], pid) for t, pid, by_name in after if name in by_name]), 1
            )
            for name in names
        }


def _past_warmups(
    points: list[tuple[float, float, int, int, float]], warmup_min: float, process_warmup_min: float
) -> Callable[[float, int], bool]:
    """Whether a sample (minute, pid) is past the run's warm-up and its own process's: a
    process is first seen at its first sample of `points` (the role's samples)."""
    first_seen: dict[int, float] = {}
    for p in points:
        first_seen.setdefault(p[3], p[0])

    def warm(minute: float, pid: int) -> bool:
        return minute >= warmup_min and minute - first_seen.get(pid, minute) >= process_warmup_min

    return warm


def slope_per_hour(points: list[tuple[float, float, int]]) -> float:
    """Growth per hour of (minute, value, pid) points: one least-squares slope shared by every
    process the role had, each with its own starting level (a restart's drop is not growth,
    and a process's own rise is); 0 without two samples of one process."""
    by_pid: dict[int, list[tuple[float, float]]] = {}
    for t, v, pid in points:
        by_pid.setdefault(pid, []).append((t, v))
    num = den = 0.0
    for series in by_pid.values():
        mean_t = sum(t for t, _ in series) / len(series)
        mean_v = sum(v for _, v in series) / len(series)
        num += sum((t - mean_t) * (v - mean_v) for t, v in series)
        den += sum((t - mean_t) ** 2 for t, _ in series)
    return 60 * num / den if den else 0.0
