"""Run every benchmark of bench/, one subprocess each, and say what ran: `make bench`, `make bench-quick`.

    python -m millstream.bench.all [--quick] [--only NAME,...]

Each module of `MODULES` runs as `python -m millstream.bench.<name> [--quick]`, one after the
other (they measure: running two at once would make each the other's load). A module that does
not exist (yet) is skipped with a line saying so, so a checkout runs what it has. At the end a
table: each module, its exit status, its wall time, and the result files it wrote (files under
bench/results/ changed while it ran). The exit status is 1 if any module failed.
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from millstream.bench.kit.rounds import RESULTS

__all__ = ["MODULES", "main"]

#: In the order they run; the quick size of all of them takes under 10 minutes on 2 cores.
MODULES = ["overhead", "pool_vs_http", "store_overhead", "async_sync", "weight_sync", "fleet"]


def written_since(started: float) -> list[Path]:
    """Files under bench/results/ modified since `started` (a time.time())."""
    return sorted(p for p in RESULTS.rglob("*") if p.is_file() and p.stat().st_mtime >= started)


def run(name: str, quick: bool) -> dict[str, Any]:
    """One module as a subprocess; its status, wall time and result files."""
    if importlib.util.find_spec(f"millstream.bench.{name}") is None:
        print(f"== {name}: skipped, millstream.bench.{name} does not exist in this checkout", flush=True)
        return {"name": name, "status": "skipped", "wall_s": 0.0, "files": []}
    cmd = [sys.executable, "-m", f"millstream.bench.{name}", *(["--quick"] if quick else [])]
    print(f"== {name}: {' '.join(cmd[1:])}", flush=True)
    started, clock = time.time(), time.perf_counter()
    rc = subprocess.run(cmd).returncode
    wall = time.perf_counter() - clock
    status = "ok" if rc == 0 else f"failed ({rc})"
    return {"name": name, "status": status, "wall_s": wall, "files": written_since(started)}


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| benchmark | status | wall s | result files |", "|---|---|---|---|"]
    for r in rows:
        files = ", ".join(str(Path(p).relative_to(RESULTS)) for p in r["files"]) or "-"
        lines.append(f"| {r['name']} | {r['status']} | {r['wall_s']:.0f} | {files} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m millstream.bench.all", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="each benchmark at its --quick size")
    p.add_argument("--only", default="", help=f"comma-separated subset of {','.join(MODULES)}")
    ns = p.parse_args(argv)
    names = [n for n in ns.only.split(",") if n] or MODULES
    unknown = [n for n in names if n not in MODULES]
    if unknown:
        p.error(f"--only: unknown {unknown}; known: {MODULES}")
    begun = time.perf_counter()
    rows = [run(name, ns.quick) for name in names]
    print(
        f"\n{table(rows)}\ntotal {time.perf_counter() - begun:.0f} s ({'quick' if ns.quick else 'full'} size)"
    )
    return 1 if any(r["status"].startswith("failed") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
