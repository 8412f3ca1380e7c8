"""What the trajectory store costs the envpool: turns/s with the store on and off.

    python -m millstream.bench.store_overhead [--quick] [--rounds 3]

Each sample is one `millstream stress` run (bench/stress.py): real envpool worker processes, the
synthetic actor with the "fast engine" settings (10,000 slots, no step time), so the envpool
itself is the bottleneck and any cost shows. The stress process stands in for the learner; with
`--store` it writes every episode it receives through the learner's `StoreWriter` (the same
thread and queue) to `store.sqlite`, as a run does. Store on and off alternate round by round
(bench/kit/rounds.py); the goal of issue 14 is a ratio within 3%.

On this 2-core machine the writer thread, the stress process, the envpool worker and the
synthetic actor share two cores, so the store's CPU is taken from the others: this is an upper
bound of what a machine with a core to spare would see.
"""

from __future__ import annotations

import argparse

from millstream.bench.kit.rounds import compare, results_dir, write_outcome
from millstream.bench.stress import stress_once
from millstream.bench.stress_suite import FAST_ENGINE

__all__ = ["main"]


def _sample(store: bool, episodes: int, concurrency: int) -> dict[str, float]:
    args = ["--env", "echo", "--episodes", str(episodes), "--concurrency", str(concurrency)]
    args += ["--actor", "synthetic", *FAST_ENGINE, *(["--store"] if store else [])]
    report = stress_once(args)
    sample = {"turns_s": float(report["turns_per_s"]), "wall_s": float(report["wall_s"])}
    if store:
        stats = report["store"]
        sample |= {
            "written": stats["written"],
            "dropped": stats["dropped"],
            "queue_peak": stats["queue_peak"],
        }
        sample["store_mb"] = stats["bytes"] / 1e6
    return sample


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m millstream.bench.store_overhead", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--quick", action="store_true", help="4,000 episodes at concurrency 1,000")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--episodes", type=int, default=20000)
    p.add_argument("--concurrency", type=int, default=5000)
    ns = p.parse_args(argv)
    episodes, concurrency = (4000, 1000) if ns.quick else (ns.episodes, ns.concurrency)
    outcome = compare(
        {
            "store off": lambda: _sample(False, episodes, concurrency),
            "store on": lambda: _sample(True, episodes, concurrency),
        },
        rounds=ns.rounds,
        metric="turns_s",
        settings={
            "episodes": episodes,
            "concurrency": concurrency,
            "env": "echo",
            "engine": "synthetic, fast",
        },
    )
    name = "store-overhead-quick" if ns.quick else "store-overhead"
    path = write_outcome(outcome, results_dir(), name)
    ratio = outcome.ratios()["store on"]
    print(f"store on / off turns/s: {ratio:.3f} (goal >= 0.97); {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
