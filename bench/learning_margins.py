"""How far a learner's reward rises against a non-learner's drift: the margins of a learning test.

    python -m millstream.bench.learning_margins --case gigpo-multiturn --runs 10 [--steps 14]

A learning test asserts that the reward of a short run rises by at least some bar. Where that bar
sits decides whether the test is flaky (a learner misses it) or toothless (a non-learner clears
it). This tool measures both sides with the test's own settings: `--runs` runs of the learner and
as many with `learner.lr=1e-12` (the same run, nothing learned: Adam moves each weight by about
the learning rate, so the reward moves only by chance), each with its own `run.seed`,
interleaved, against one shared real vLLM-CPU actor on the tiny model, as the tests run. The
rise is the test's measure: the mean reward of the last 4 steps less that of the first 4. It
prints both distributions (min, quartiles, max) and the gap between the learners' minimum and
the non-learners' maximum; the test's docstring cites them and puts its bar in the gap.

Results: bench/results/<date>-<host>/learning-margins-<case>.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import orjson

from millstream.bench.async_sync import start_vllm_actor
from millstream.bench.kit.rounds import results_dir
from millstream.shared.models.tiny import build_tiny_model
from millstream.shared.obs.metrics import read_jsonl

__all__ = ["CASES", "rise", "main"]

ROOT = Path(__file__).resolve().parent.parent

#: The learning tests' settings, by the test id they come from.
CASES: dict[str, list[str]] = {
    # tests/test_algorithms_run.py::test_estimator_learns
    "drgrpo": ["learner.advantage=drgrpo", "learner.loss_agg=seq_sum_norm"],
    "gigpo-multiturn": ["learner.advantage=gigpo", "learner.reward_level=turn", "envpool.env_args={turns=3}"],
}


def rise(metrics: Path, n: int = 4) -> float:
    """Mean reward of the last `n` steps less that of the first `n` (the tests' measure)."""
    steps = [r for r in read_jsonl(metrics) if "reward/mean" in r and not r.get("rolled_back")]
    first = statistics.fmean(r["reward/mean"] for r in steps[:n])
    return statistics.fmean(r["reward/mean"] for r in steps[-n:]) - first


def run_once(run_dir: Path, overrides: list[str], timeout_s: float) -> float:
    cmd = [sys.executable, "-m", "millstream.shared.launch.cli", "run", f"run.dir={run_dir}", *overrides]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        raise RuntimeError(f"run failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return rise(run_dir / "metrics.jsonl")


def quartiles(values: list[float]) -> dict[str, float]:
    q = statistics.quantiles(values, n=4) if len(values) > 1 else values * 3
    return {"min": min(values), "q1": q[0], "median": q[1], "q3": q[2], "max": max(values)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--case", choices=sorted(CASES), default="gigpo-multiturn")
    parser.add_argument("--runs", type=int, default=10, help="runs of each side (default 10)")
    parser.add_argument("--steps", type=int, default=14, help="train.steps of each run (default 14)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds one run may take")
    ns = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="margins-"))
    model = build_tiny_model(work / "tiny", seed=0)
    address, actor = start_vllm_actor(model, work)
    base = [
        f"model.path={model}",
        f"actor.connect={address}",
        "transport.curve=false",
        f"train.steps={ns.steps}",
        *CASES[ns.case],
    ]
    sides: dict[str, list[float]] = {"learner": [], "non_learner": []}
    started = time.monotonic()
    try:
        for i in range(ns.runs):  # interleaved: a drift of the machine hits both sides alike
            for side, extra in (("learner", []), ("non_learner", ["learner.lr=1e-12"])):
                value = run_once(work / f"{side}-{i}", [*base, f"run.seed={i}", *extra], ns.timeout)
                sides[side].append(value)
                print(f"{side} run {i}: rise {value:+.3f}", flush=True)
    finally:
        os.killpg(actor.pid, 15)
        actor.wait(timeout=60)
    summary = {
        "case": ns.case,
        "overrides": CASES[ns.case],
        "steps": ns.steps,
        "runs": ns.runs,
        "rises": sides,
        "learner": quartiles(sides["learner"]),
        "non_learner": quartiles(sides["non_learner"]),
        "gap": min(sides["learner"]) - max(sides["non_learner"]),
        "wall_s": time.monotonic() - started,
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "load": os.getloadavg()[0],
    }
    out = results_dir() / f"learning-margins-{ns.case}.json"
    out.write_bytes(orjson.dumps(summary, option=orjson.OPT_INDENT_2))
    print(orjson.dumps({k: summary[k] for k in ("learner", "non_learner", "gap")}).decode())
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
