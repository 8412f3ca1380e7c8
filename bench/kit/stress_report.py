"""What `millstream stress` reports: the workers' statistics over time, a table, JSON and a plot.

Each envpool worker writes a statistics record every `envpool.stats_every_s` to
`<run.dir>/envpool-w<i>.jsonl` (envpool/worker.py): cumulative counts, live episodes, resident
memory, socket queues and the histogram of the turn latencies of that interval.
`StatsFollower` reads those files as they grow; the timeline sums workers per one-second bin and
merges their latency histograms, so percentiles are over turns, not averages of averages.

Memory per live episode is measured, not estimated, and reported conservatively: a worker's
highest resident memory minus its memory before it admitted any episode, divided by its peak of
live episodes (the value at the moment of that peak is reported too; it is lower, because
episodes that just started hold short contexts). Freed memory the allocator keeps counts.
"""

from __future__ import annotations

import math
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import orjson

from millstream.shared.obs.metrics import LatencyHistogram

__all__ = ["ResultWindow", "StatsFollower", "build_report", "format_table", "plot_report", "write_json"]


class ResultWindow:
    """Turns/s between the first and the last finished episode, as the receiving side sees them.

    A run's wall time also holds its start (processes, imports, tokenizer, handshakes: a second
    or two) and its shutdown handshake, which dwarf a short benchmark sample; comparing two
    systems needs the same clock on both, so each counts the turns of the episodes that ended
    after its first one over the time from that first to its last.
    """

    def __init__(self) -> None:
        self.first: float | None = None
        self.last = 0.0
        self.turns = 0
        self.episodes = 0

    def saw(self, turns: int) -> None:
        """One episode ended now (a failed one with 0 turns still marks the clock)."""
        now = time.perf_counter()
        if self.first is None:
            self.first = now
            return
        self.last, self.turns, self.episodes = now, self.turns + turns, self.episodes + 1

    def summary(self) -> dict[str, float]:
        span = self.last - self.first if self.first is not None and self.last > self.first else 0.0
        return {"turns_per_s": self.turns / span if span else 0.0, "window_s": span, "turns": self.turns}


class StatsFollower:
    """Tails every `envpool-w*.jsonl` in a folder; keeps the records per worker."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.records: dict[str, list[dict[str, Any]]] = defaultdict(list)
        self._offsets: dict[Path, int] = {}
        self._partial: dict[Path, bytes] = {}

    def poll(self) -> None:
        for path in sorted(self.folder.glob("envpool-w*.jsonl")):
            with path.open("rb") as f:
                f.seek(self._offsets.get(path, 0))
                data = self._partial.pop(path, b"") + f.read()
                self._offsets[path] = f.tell()
            *lines, rest = data.split(b"\n")
            if rest:
                self._partial[path] = rest  # a record being written: finish it next time
            for line in lines:
                if line:
                    record = orjson.loads(line)
                    self.records[record["worker"]].append(record)

    def latest(self) -> list[dict[str, Any]]:
        return [recs[-1] for recs in self.records.values() if recs]

    def timeline(self) -> list[dict[str, Any]]:
        """Per one-second bin since the first record: turns/s, episodes/s, latency, live, memory.

        A worker's rates come from consecutive records (delta over their time apart), so a bin
        that happens to hold two records of a worker, or none, does not show a spike or a gap.
        """
        if not self.records:
            return []
        t0 = min(recs[0]["time"] for recs in self.records.values() if recs)
        bins: dict[int, dict[str, Any]] = {}
        for recs in self.records.values():
            for previous, r in zip([None, *recs], recs):
                b = bins.setdefault(
                    int(r["time"] - t0), {"rates": {}, "live": {}, "rss": {}, "hist": LatencyHistogram()}
                )
                if previous is not None and r["time"] > previous["time"]:
                    dt = r["time"] - previous["time"]
                    ended = (
                        r["finished"]
                        + sum(r["failed"].values())
                        - previous["finished"]
                        - sum(previous["failed"].values())
                    )
                    b["rates"].setdefault(r["worker"], []).append(
                        ((r["turns"] - previous["turns"]) / dt, ended / dt)
                    )
                b["live"][r["worker"]] = r["live"]
                b["rss"][r["worker"]] = r["rss_bytes"]
                b["hist"].merge(LatencyHistogram.from_dict(r["turn_latency"]))
        rows = []
        for second in sorted(bins):
            b = bins[second]
            means = [tuple(sum(x) / len(x) for x in zip(*rates)) for rates in b["rates"].values()]
            rows.append(
                {
                    "t": second,
                    "turns": sum(m[0] for m in means),
                    "episodes": sum(m[1] for m in means),
                    "live": sum(b["live"].values()),
                    "rss_mb": sum(b["rss"].values()) / 2**20,
                    "p50_s": b["hist"].percentile(50),
                    "p99_s": b["hist"].percentile(99),
                }
            )
        return rows

    def latency(self) -> LatencyHistogram:
        hist = LatencyHistogram()
        for recs in self.records.values():
            for r in recs:
                hist.merge(LatencyHistogram.from_dict(r["turn_latency"]))
        return hist

    def memory(self) -> dict[str, Any]:
        per_worker = {}
        for worker, recs in self.records.items():
            base = recs[0]["rss_bytes"]
            peak = max(recs, key=lambda r: r["live"])
            top = max(r["rss_bytes"] for r in recs)
            per_worker[worker] = {
                "rss_start_mb": base / 2**20,
                "rss_peak_mb": top / 2**20,
                "peak_live": peak["live"],
                # Conservative: the worker's highest memory, whenever it came, over its most
                # live episodes (later in a run episodes hold longer contexts).
                "bytes_per_live_episode": (top - base) / peak["live"] if peak["live"] else None,
                # The memory when the most episodes were live (most of them just started).
                "bytes_per_live_episode_at_peak_live": (
                    (peak["rss_bytes"] - base) / peak["live"] if peak["live"] else None
                ),
            }
        return per_worker

    def progress_line(self, elapsed: float, accounted: int, total: int, outcomes: Counter) -> str:
        latest = self.latest()
        live = sum(r["live"] for r in latest)
        rss = sum(r["rss_bytes"] for r in latest) / 2**20
        recent = [r for recs in self.records.values() for r in recs[-3:]]
        hist = LatencyHistogram()
        for r in recent:
            hist.merge(LatencyHistogram.from_dict(r["turn_latency"]))
        rate = _recent_rate(self.records.values())
        failed = sum(v for k, v in outcomes.items() if k != "completed")
        p50, p99 = hist.percentile(50), hist.percentile(99)
        return (
            f"[{elapsed:6.0f}s] {accounted}/{total} episodes ({failed} failed)  live {live}  "
            f"{rate:7.0f} turns/s  p50 {_ms(p50)}  p99 {_ms(p99)}  rss {rss:.0f} MB"
        )


def _recent_rate(worker_records) -> float:
    rate = 0.0
    for recs in worker_records:
        if len(recs) >= 2:
            a, b = recs[max(0, len(recs) - 4)], recs[-1]
            if b["time"] > a["time"]:
                rate += (b["turns"] - a["turns"]) / (b["time"] - a["time"])
    return rate


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f} ms"


def build_report(
    *,
    args: dict,
    faults: dict,
    wall_s: float,
    setup_s: float,
    outcomes: Counter,
    turns: int,
    invalid_actions: int,
    pool_done: list,
    follower: StatsFollower,
    episodes: int,
) -> dict[str, Any]:
    started = sum(d.episodes_started for d in pool_done)
    accounted = sum(outcomes.values())
    hist = follower.latency()
    memory = follower.memory()
    per_episode = [
        m["bytes_per_live_episode"] for m in memory.values() if m["bytes_per_live_episode"] is not None
    ]
    failures = {k: v for k, v in sorted(outcomes.items()) if k != "completed"}
    return {
        "args": {k: v for k, v in args.items() if k != "overrides"} | {"set": args.get("overrides")},
        "faults": faults,
        "episodes": {
            "asked": episodes,
            "started": started,
            "completed": outcomes["completed"],
            "failed": sum(failures.values()),
            "accounted": accounted,
        },
        "failures_by_cause": failures,
        # Started by a worker but never reported: must be 0. Workers that never sent PoolDone
        # make `started` unknown; then everything asked and unaccounted counts as lost.
        "lost": (started - accounted) if len(pool_done) == args["workers"] else episodes - accounted,
        "not_started": episodes - started if len(pool_done) == args["workers"] else None,
        "turns": turns,
        "invalid_actions": invalid_actions,
        "wall_s": wall_s,
        "setup_s": setup_s,
        "turns_per_s": turns / wall_s if wall_s else None,
        "episodes_per_s": accounted / wall_s if wall_s else None,
        "turn_latency_s": {
            "p50": hist.percentile(50),
            "p95": hist.percentile(95),
            "p99": hist.percentile(99),
            "mean": hist.mean(),
            "count": hist.total,
        },
        "peak_live": sum(m["peak_live"] for m in memory.values()),
        "bytes_per_live_episode": sum(per_episode) / len(per_episode) if per_episode else None,
        "memory": memory,
        "sockets": {
            r["worker"]: {"actor": r["actor_socket"], "learner": r["learner_socket"], "client": r["client"]}
            for r in follower.latest()
        },
        "timeline": follower.timeline(),
    }


def format_table(report: dict[str, Any]) -> str:
    e, lat = report["episodes"], report["turn_latency_s"]
    per_ep = report["bytes_per_live_episode"]
    rows = [
        (
            "episodes",
            f"{e['asked']} asked, {e['started']} started, {e['completed']} completed, {e['failed']} failed",
        ),
        ("wall time", f"{report['wall_s']:.1f} s (+{report['setup_s']:.1f} s start-up)"),
        (
            "turns",
            f"{report['turns']} ({report['turns_per_s'] or 0:.0f}/s), "
            f"{report['invalid_actions']} invalid (format penalty)",
        ),
        ("episodes/s", f"{report['episodes_per_s'] or 0:.0f}"),
        ("turn latency", f"p50 {_ms(lat['p50'])}, p95 {_ms(lat['p95'])}, p99 {_ms(lat['p99'])}"),
        ("peak live", f"{report['peak_live']}"),
        ("memory/live episode", "-" if per_ep is None else f"{per_ep / 1024:.1f} KiB"),
    ]
    per_turn = report.get("cpu", {}).get("us_per_turn")
    if per_turn:
        rows.append(("CPU per turn", ", ".join(f"{k} {v:.0f} us" for k, v in per_turn.items())))
    for cause, count in report["failures_by_cause"].items():
        rows.append((f"failed: {cause}", str(count)))
    rows.append(("LOST", str(report["lost"])))
    if report["not_started"]:
        rows.append(("not started", str(report["not_started"])))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def write_json(report: dict[str, Any], path: Path) -> None:
    path.write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2))


def plot_report(follower: StatsFollower, path: Path, *, title: str) -> None:
    """Throughput, turn latency and live episodes over time, one panel each."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = follower.timeline()
    t = [r["t"] for r in rows]
    fig, axes = plt.subplots(3, 1, figsize=(9, 8), sharex=True)
    axes[0].plot(t, [r["turns"] for r in rows], label="turns/s")
    axes[0].plot(t, [r["episodes"] for r in rows], label="episodes/s")
    axes[0].set_ylabel("per second")
    axes[0].legend(loc="upper right")
    for key, label in (("p50_s", "p50"), ("p99_s", "p99")):
        axes[1].plot(t, [math.nan if r[key] is None else r[key] * 1000 for r in rows], label=label)
    axes[1].set_ylabel("turn latency (ms)")
    axes[1].set_yscale("log")
    axes[1].legend(loc="upper right")
    axes[2].plot(t, [r["live"] for r in rows], label="live episodes")
    axes[2].set_ylabel("live episodes")
    mem = axes[2].twinx()
    mem.plot(t, [r["rss_mb"] for r in rows], color="tab:red", label="worker RSS (MB)")
    mem.set_ylabel("RSS (MB)")
    axes[2].set_xlabel("seconds")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
