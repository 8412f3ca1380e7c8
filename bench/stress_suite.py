"""The recorded envpool scale benchmarks: `make bench-stress` (or `python -m millstream.bench.stress_suite`).

Runs each scenario below through `millstream stress` (bench/stress.py), keeps its `report.json`
and `stress.png` in `bench/results/<scenario>/`, and writes `bench/results/summary.md`, the table
that bench/README.md quotes. `--only NAME` runs one scenario.

The scenarios ask two different questions:
- with the synthetic actor's defaults (64 sequences in flight, a few ms per decode step), the
  actor is the bottleneck, as a real engine would be: does the envpool hold 10,000 waiting
  episodes without losing one, and what do queueing latencies look like;
- with a "fast engine" (10,000 slots, zero step time), the actor costs only its own Python, so
  the numbers are the envpool's ceiling on this machine: how many turns a second one worker
  process sustains, and what it costs per live episode.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

import orjson

__all__ = ["SCENARIOS", "main"]

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
FAST_ENGINE = [
    "--set",
    "actor.max_num_seqs=10000",
    "--set",
    "actor.synthetic_step_s=0",
    "--set",
    "actor.synthetic_step_s_per_seq=0",
    "--set",
    "actor.synthetic_prefill_s_per_token=0",
]
ECHO_20K = ["--env", "echo", "--episodes", "20000", "--concurrency", "10000", "--actor", "synthetic"]

SCENARIOS: dict[str, list[str]] = {
    "echo-20k-c10k": ECHO_20K,
    "echo-20k-c10k-fast-engine": ECHO_20K + FAST_ENGINE,
    "echo-20k-c10k-faults": ECHO_20K + ["--faults", "crash=0.01,hang=0.01,garbage=0.05"],
    "echo-20k-c10k-2workers-fast-engine": ECHO_20K + ["--workers", "2"] + FAST_ENGINE,
    "frozenlake-4k-c2k": [
        "--env",
        "frozenlake",
        "--episodes",
        "4000",
        "--concurrency",
        "2000",
        "--actor",
        "synthetic",
    ],
    "sokoban-4k-c2k": [
        "--env",
        "sokoban",
        "--episodes",
        "4000",
        "--concurrency",
        "2000",
        "--actor",
        "synthetic",
    ],
}


def run_scenario(name: str, args: list[str], scratch: Path) -> dict:
    out = scratch / name
    if out.exists():
        shutil.rmtree(out)
    cmd = [sys.executable, "-m", "millstream.bench.stress", *args, "--out", str(out)]
    print("$ millstream stress " + " ".join(args), flush=True)
    subprocess.run(cmd, cwd=ROOT, check=False)
    keep = RESULTS / name
    keep.mkdir(parents=True, exist_ok=True)
    for file in ("report.json", "stress.png"):
        shutil.copy(out / file, keep / file)
    return orjson.loads((keep / "report.json").read_bytes())


def summary_row(name: str, r: dict) -> str:
    lat = r["turn_latency_s"]
    fails = ", ".join(f"{k} {v}" for k, v in r["failures_by_cause"].items()) or "-"
    per_ep = r["bytes_per_live_episode"]
    return (
        f"| {name} | {r['episodes']['started']} | {r['peak_live']} | {r['wall_s']:.1f} | "
        f"{r['turns_per_s']:.0f} | {lat['p50'] * 1000:.0f} / {lat['p95'] * 1000:.0f} / "
        f"{lat['p99'] * 1000:.0f} | {'-' if per_ep is None else f'{per_ep / 1024:.1f}'} | "
        f"{fails} | {r['invalid_actions']} | {r['lost']} |"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m millstream.bench.stress_suite")
    parser.add_argument("--only", choices=sorted(SCENARIOS), default=None)
    parser.add_argument("--scratch", default="runs/bench-stress", help="full outputs go here")
    ns = parser.parse_args(argv)
    scratch = (ROOT / ns.scratch).resolve()
    names = [ns.only] if ns.only else list(SCENARIOS)
    reports = {name: run_scenario(name, SCENARIOS[name], scratch) for name in names}
    rows = [summary_row(n, r) for n, r in reports.items()]
    table = "\n".join(
        [
            "| scenario | episodes | peak live | wall s | turns/s | turn latency p50 / p95 / p99 ms "
            "| KiB per live episode | failed by cause | invalid turns | lost |",
            "|---|---|---|---|---|---|---|---|---|---|",
            *rows,
        ]
    )
    commands = "\n".join(f"- `{n}`: `millstream stress {' '.join(SCENARIOS[n])}`" for n in names)
    (RESULTS / "summary.md").write_text(f"{table}\n\n{commands}\n")
    print(table)
    sys.exit(1 if any(r["lost"] for r in reports.values()) else 0)


if __name__ == "__main__":
    main()
