"""Async against sync: wall time to train the same tokens, `train.max_staleness` 0 against 1, 2, 4.

    python -m millstream.bench.async_sync [--quick] [--stacks synthetic,real,real-tail] [--rounds 3]

Each sample is one whole `millstream run` (launcher, envpool, learner, actor), as a user runs it.
Full size: the three stacks below, staleness 0, 1, 2, 4, 3 rounds (about 30 minutes here). `--quick`:
the synthetic stack only, staleness 0 against 4, short runs (about 2-3 minutes); the real stack
takes a minute to start its vLLM actor and ~25 s a run, too long for `make bench-quick`
(`--quick --stacks real` runs it small).
`train.max_staleness=0` is the synchronous baseline: the envpool admits a batch only after the
learner has trained the one before (the admission limit is `(v + k + 1) * B` groups), so
generation waits for training and training waits for the batch's longest episode. With k > 0
up to k more batches generate while the learner trains, and the long tail of one batch overlaps
the next.

Output lengths are long-tailed on purpose, because that is where a synchronous batch loses:
- `synthetic` stack: the synthetic actor (actor/synthetic.py, a timing model of a continuously
  batching engine, not a language model) draws each turn's length from a lognormal
  (`actor.synthetic_length_median`, `actor.synthetic_length_sigma`), capped by
  `envpool.max_tokens`; the learner is the real DeepSpeed learner on the tiny model.
- `real` stack: one real vLLM-CPU actor (tiny model), started once and shared by every run
  (`actor.connect`), and the real DeepSpeed learner. Turns are capped at 64 tokens, which most
  of the tiny model's samples reach, so this stack measures the overlap of generation and
  training, not the tail.
- `real-tail` stack: the same, with the tail: one turn of up to 512 tokens, whatever lengths the
  tiny model samples at temperature 1 (its end-of-turn token comes at random: a mean of 294
  tokens a turn in the sync runs of 2026-11-28, p95 at the cap). A sync batch of 16 waits for
  its longest.

Measured per run, from its metrics.jsonl: `train_s`, the learner's `perf/elapsed_s` at the last
step (from the moment it starts waiting for its first batch: process start-up is left out, it
is the same for every setting); `tokens`, the generated tokens it trained (sum of
`batch/generated_tokens`); `tokens_per_s` = tokens / train_s, the metric the ratios are taken
of. Ratio = async tokens/s over sync tokens/s = sync time / async time for the same tokens.
The settings run interleaved round by round (bench/kit/rounds.py). Results:
bench/results/<date>-<host>/async-sync-<stack>.json and .png.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import orjson

from millstream.bench.kit.rounds import Outcome, compare, results_dir, write_outcome
from millstream.bench.kit.scratch import scratch
from millstream.bench.kit.spawn import spawn, stop
from millstream.shared.models.tiny import build_tiny_model
from millstream.shared.obs.metrics import read_jsonl

__all__ = ["main", "run_once", "STACKS"]

ROOT = Path(__file__).resolve().parent.parent
MILLSTREAM = [sys.executable, "-m", "millstream.shared.launch.cli"]

#: Overrides common to every setting, per stack and size. Same batch shape for every staleness.
STACKS: dict[str, dict[str, list[str]]] = {
    "synthetic": {
        "full": [
            "train.steps=20", "train.groups_per_batch=8", "train.group_size=8",
            "actor.max_num_seqs=256", "actor.synthetic_step_s=0.004",
            "actor.synthetic_length_median=24", "actor.synthetic_length_sigma=1.2",
            "envpool.max_tokens=512", "envpool.env_args.turns=1",
        ],
        "quick": [
            "train.steps=6", "train.groups_per_batch=4", "train.group_size=8",
            "actor.max_num_seqs=256", "actor.synthetic_step_s=0.004",
            "actor.synthetic_length_median=24", "actor.synthetic_length_sigma=1.2",
            "envpool.max_tokens=512", "envpool.env_args.turns=1",
        ],
    },
    "real": {
        "full": ["train.steps=8", "train.groups_per_batch=2", "train.group_size=8", "envpool.max_tokens=64"],
        "quick": ["train.steps=3", "train.groups_per_batch=2", "train.group_size=4", "envpool.max_tokens=32"],
    },
    "real-tail": {
        "full": [
            "train.steps=8", "train.groups_per_batch=2", "train.group_size=8",
            "envpool.max_tokens=512", "envpool.env_args.turns=1",
        ],
        "quick": [
            "train.steps=3", "train.groups_per_batch=2", "train.group_size=4",
            "envpool.max_tokens=512", "envpool.env_args.turns=1",
        ],
    },
}  # fmt: skip
COMMON = [
    "transport.curve=false",
    "envpool.env=echo",
    "learner.checkpoint_every=1000",
    "run.log_level=WARNING",
]


def run_once(run_dir: Path, overrides: list[str], timeout_s: float) -> dict[str, float]:
    """One `millstream run`; its training wall time and trained tokens from metrics.jsonl."""
    shutil.rmtree(run_dir, ignore_errors=True)
    started = time.perf_counter()
    proc = subprocess.run(
        [*MILLSTREAM, "run", f"run.dir={run_dir}", *COMMON, *overrides],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        logs = "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}" for p in (run_dir / "logs").glob("*.log"))
        raise RuntimeError(f"millstream run failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{logs}")
    steps = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "reward/mean" in r]
    tokens = sum(r["batch/generated_tokens"] for r in steps)
    train_s = steps[-1]["perf/elapsed_s"]
    dropped = orjson.loads((run_dir / "summary.json").read_bytes())["episodes_dropped"]
    return {
        "tokens_per_s": tokens / train_s,
        "train_s": train_s,
        "tokens": tokens,
        "steps": len(steps),
        "run_wall_s": wall,
        "staleness_mean": statistics.fmean(r["staleness/mean"] for r in steps),
        "response_len_p95": statistics.median(r["episode/response_len/p95"] for r in steps),
        "response_len_mean": statistics.fmean(r["episode/response_len/mean"] for r in steps),
        "sync_paused_s": statistics.median(r["sync/actor_paused_s"] for r in steps),
        "dropped_stale": dropped.get("stale", 0),
    }


def start_vllm_actor(model: Path, work: Path) -> tuple[str, subprocess.Popen]:
    """One real vLLM-CPU actor for every run of the real stack (about a minute to start)."""
    from millstream.shared.process.runtime import free_port

    address = f"tcp://127.0.0.1:{free_port()}"
    ready, log = work / "actor-ready.json", work / "actor.log"
    cmd = [
        sys.executable, "-m", "millstream.actor", "--ready-file", str(ready), f"model.path={model}",
        f"actor.address={address}", "transport.curve=false", "run.log_level=WARNING",
    ]  # fmt: skip
    with log.open("wb") as out:
        proc = spawn(cmd, cwd=ROOT, stdout=out, stderr=out)
    deadline = time.monotonic() + 600
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            stop(proc, grace_s=0)  # its group: an engine process it started goes too
            raise RuntimeError(f"the vLLM actor did not start:\n{log.read_text()[-3000:]}")
        time.sleep(0.5)
    return address, proc


def measure(stack: str, ns: argparse.Namespace, work: Path) -> Outcome:
    """Every staleness of `ns.staleness`, interleaved over `ns.rounds` rounds, on `stack`."""
    model = build_tiny_model(work / "tiny", seed=0)
    base = [f"model.path={model}", *STACKS[stack]["quick" if ns.quick else "full"]]
    actor: subprocess.Popen | None = None
    if stack == "synthetic":
        base.append("actor.kind=synthetic")
    else:
        address, actor = start_vllm_actor(model, work)
        base.append(f"actor.connect={address}")
    runs = iter(range(10**6))

    def system(k: int) -> Callable[[], dict[str, float]]:
        return lambda: run_once(work / f"run-{next(runs)}", [*base, f"train.max_staleness={k}"], ns.timeout)

    try:
        systems = {f"staleness={k}": system(k) for k in ns.staleness}
        settings = {"stack": stack, "overrides": [*COMMON, *base[1:]], "staleness": ns.staleness}
        return compare(systems, rounds=ns.rounds, metric="tokens_per_s", settings=settings)
    finally:
        if actor is not None:
            stop(actor, grace_s=60)


def table(outcome: Outcome) -> str:
    s = outcome.summary()
    rows = [
        "| setting | tokens/s (median, min-max) | train s | tokens | ratio to sync |",
        "|---|---|---|---|---|",
    ]
    for name, m in s["systems"].items():
        t = m["tokens_per_s"]
        rows.append(
            f"| {name} | {t['median']:.0f} ({t['min']:.0f}-{t['max']:.0f}) | {m['train_s']['median']:.1f} | "
            f"{m['tokens']['median']:.0f} | {s['ratios'][name]:.2f}x |"
        )
    return "\n".join(rows)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m millstream.bench.async_sync", description=__doc__.split("\n")[0]
    )
    p.add_argument("--quick", action="store_true", help="small runs (bench-quick)")
    p.add_argument("--stacks", default=None, help="synthetic,real,real-tail (quick default: synthetic only)")
    p.add_argument(
        "--staleness",
        default=None,
        help="train.max_staleness values, the first is the reference (quick: 0,4)",
    )
    p.add_argument("--rounds", type=int, default=3, help="rounds (every setting once per round)")
    p.add_argument("--timeout", type=float, default=600, help="seconds one run may take")
    p.add_argument("--out", default=None, help="results folder (bench/results/<date>-<host>/)")
    ns = p.parse_args(argv)
    ns.staleness = [int(k) for k in (ns.staleness or ("0,4" if ns.quick else "0,1,2,4")).split(",")]
    ns.stacks = (ns.stacks or ("synthetic" if ns.quick else ",".join(STACKS))).split(",")
    unknown = set(ns.stacks) - set(STACKS)
    if unknown:
        p.error(f"--stacks: unknown {sorted(unknown)}; known: {sorted(STACKS)}")
    return ns


def main(argv: list[str] | None = None) -> list[Path]:
    ns = parse(argv)
    folder, written = Path(ns.out) if ns.out else results_dir(), []
    with scratch("millstream-async-sync-") as work:
        for stack in ns.stacks:
            outcome = measure(stack, ns, work)
            name = f"async-sync-{stack}{'-quick' if ns.quick else ''}"
            written.append(write_outcome(outcome, folder, name, {"table": table(outcome)}))
            print(f"\n{stack} stack:\n{table(outcome)}")
    for path in written:
        print(path, path.with_suffix(".png"))
    print(orjson.dumps([str(p) for p in written]).decode())
    return written


if __name__ == "__main__":
    main()
