"""Does millstream make a real model better at a real task, on this machine? Measured, not assumed.

    make real-model                                   # once: SmolLM2-135M-Instruct (93 MB download)
    python -m millstream.bench.learning.real_model [--seeds 3] [--variants full,lora] [--set key=value ...]

Each run is `millstream run examples/cpu-smollm2.toml` (SmolLM2-135M-Instruct on a reasoning-gym
task, greedy evaluation on held-out items at version 0 and every `eval.every` versions), once per
seed and variant: `full` fine-tunes every weight, `lora` trains adapters only (`VARIANTS`).
Runs go seed by seed, the variants alternating inside a seed (full, lora, then lora, full), so
both variants see the same hours of the machine.

From each run it reports:
- the held-out eval accuracy at version 0 and at the end, and the rise (the issue's goal: at
  least +15 points within 30 minutes of wall time);
- seconds per step, split into training (`train/step_time_s`), weight sync (`sync/total_s`, of
  which the actor was paused `sync/actor_paused_s`) and the rest, which is waiting for a batch of
  episodes (generation, since the actor works meanwhile);
- tokens/s generated (by the actor, eval included) and trained;
- each role's peak resident memory, its child processes included (vLLM's engine core), sampled
  every `--sample-s` seconds.

Across seeds: the median and range of each. Results: bench/results/<date>-<host>/real-model.json
and real-model.png (the eval curve and the reward curve of every run).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson

from millstream.bench.kit.procstat import tree_rss_bytes
from millstream.bench.kit.rounds import machine, results_dir
from millstream.shared.obs.metrics import read_jsonl, step_records

__all__ = ["VARIANTS", "ROLES", "summarize_run", "main"]

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "examples" / "cpu-smollm2.toml"

#: What each variant adds to the example's settings (full: its learning rate, 2e-5). LoRA trains
#: a few million weights from zero instead of 134M trained ones, so it takes a learning rate about
#: ten times the full one's.
VARIANTS: dict[str, list[str]] = {
    "full": [],
    "lora": ["learner.lora_rank=16", "learner.lora_alpha=32", "learner.lr=2e-4"],
}

PROG = "python -m millstream.bench.learning.real_model"

#: The roles whose memory is sampled: their pid files in the run directory.
ROLES = ("actor", "learner", "envpool-0")


def _run_once(
    config: Path, variant: str, seed: int, extra: list[str], work: Path, ns: argparse.Namespace
) -> dict:
    """One `millstream run`, its memory sampled while it runs; returns its summary."""
    run_dir = work / f"{variant}-seed{seed}"
    cmd = [
        sys.executable, "-m", "millstream.shared.launch.cli", "run", str(config), "--quiet",
        f"run.dir={run_dir}", f"run.seed={seed}", *VARIANTS[variant], *extra,
    ]  # fmt: skip
    print(f"[{time.strftime('%H:%M:%S')}] {variant} seed {seed}: {' '.join(cmd[3:])}", flush=True)
    peaks = dict.fromkeys(ROLES, 0)
    started = time.monotonic()
    log = work / f"{variant}-seed{seed}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
        try:
            while proc.poll() is None:
                if time.monotonic() - started > ns.limit_min * 60:
                    proc.terminate()  # the launcher stops every role and saves what it has
                    proc.wait(timeout=300)
                    break
                _sample_memory(run_dir, peaks)
                time.sleep(ns.sample_s)
        finally:
            if proc.poll() is None:
                proc.kill()
    wall_s = time.monotonic() - started
    if not (run_dir / "metrics.jsonl").exists():
        raise RuntimeError(
            f"{variant} seed {seed} wrote no metrics (exit {proc.returncode}):\n{log.read_text()[-3000:]}"
        )
    summary = summarize_run(run_dir)
    summary.update(variant=variant, seed=seed, exit=proc.returncode, wall_s=wall_s)
    summary["peak_rss_mb"] = {role: round(b / 2**20) for role, b in peaks.items()}
    print(f"    {_line(summary)}", flush=True)
    return summary


def _sample_memory(run_dir: Path, peaks: dict[str, int]) -> None:
    for role in ROLES:
        try:
            pid = int((run_dir / f"{role}.pid").read_text().strip())
        except (OSError, ValueError):
            continue
        peaks[role] = max(peaks[role], tree_rss_bytes(pid))


def summarize_run(run_dir: Path) -> dict[str, Any]:
    """Eval before and after, step-time split, token rates and curves, from a run's metrics.jsonl."""
    records = read_jsonl(run_dir / "metrics.jsonl")
    steps = step_records(records)
    evals = sorted(
        ((r["eval/version"], r["eval/success"]) for r in records if "eval/version" in r), key=lambda e: e[0]
    )
    out: dict[str, Any] = {
        "steps": len(steps),
        "eval_curve": evals,
        "reward_curve": [r["reward/mean"] for r in steps],
        "eval_start": evals[0][1] if evals and evals[0][0] == 0 else None,
        "eval_end": evals[-1][1] if evals else None,
        "eval_end_version": evals[-1][0] if evals else None,
    }
    if out["eval_start"] is not None and out["eval_end"] is not None:
        out["eval_rise"] = out["eval_end"] - out["eval_start"]
    if steps:
        out.update(_step_split(steps))
    return out


def _step_split(steps: list[dict]) -> dict[str, float]:
    """Medians over the steps after the first (which waits for the engine's first batch)."""
    body = steps[1:] or steps
    med = {k: statistics.median(float(r.get(k, 0.0)) for r in body) for k in _SPLIT_KEYS}
    elapsed = steps[-1]["perf/elapsed_s"]
    return {
        "step_s": med["perf/step_s"],
        "train_s": med["train/step_time_s"],
        "sync_s": med["sync/total_s"],
        "actor_paused_s": med["sync/actor_paused_s"],
        "wait_s": max(0.0, med["perf/step_s"] - med["train/step_time_s"] - med["sync/total_s"]),
        "trained_tokens_per_s": sum(r.get("train/tokens", 0.0) for r in steps) / elapsed,
        "generated_tokens_per_s": steps[-1].get("fleet/actor/tokens", 0.0) / elapsed,
        "train_elapsed_s": elapsed,
    }


_SPLIT_KEYS = ("perf/step_s", "train/step_time_s", "sync/total_s", "sync/actor_paused_s")


def _line(s: dict) -> str:
    rise = s.get("eval_rise")
    return (
        f"eval {_pct(s.get('eval_start'))} -> {_pct(s.get('eval_end'))} (v{s.get('eval_end_version')}, "
        f"{'%+.1f' % (100 * rise) if rise is not None else '?'} points) in {s['wall_s'] / 60:.1f} min, "
        f"{s['steps']} steps; step {s.get('step_s', 0):.1f}s = train {s.get('train_s', 0):.1f} + sync "
        f"{s.get('sync_s', 0):.1f} + wait {s.get('wait_s', 0):.1f}; peak MB {s['peak_rss_mb']}"
    )


def _pct(x: float | None) -> str:
    return "?" if x is None else f"{100 * x:.1f}%"


def aggregate(runs: list[dict]) -> dict[str, dict]:
    """Per variant: median and range over seeds of every number."""
    keys = ("eval_start", "eval_end", "eval_rise", "wall_s", "step_s", "train_s", "sync_s", "actor_paused_s",
            "wait_s", "generated_tokens_per_s", "trained_tokens_per_s")  # fmt: skip
    table: dict[str, dict] = {}
    for variant in dict.fromkeys(r["variant"] for r in runs):
        mine = [r for r in runs if r["variant"] == variant]
        row: dict[str, Any] = {"seeds": [r["seed"] for r in mine]}
        for k in keys:
            values = [r[k] for r in mine if r.get(k) is not None]
            if values:
                row[k] = {"median": statistics.median(values), "min": min(values), "max": max(values)}
        for role in ROLES:
            row[f"peak_rss_mb/{role}"] = max(r["peak_rss_mb"][role] for r in mine)
        table[variant] = row
    return table


def plot(runs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ev, rw) = plt.subplots(1, 2, figsize=(11, 4))
    for r in runs:
        label = f"{r['variant']} seed {r['seed']}"
        style = "-" if r["variant"] == "full" else "--"
        if r["eval_curve"]:
            ev.plot(*zip(*r["eval_curve"], strict=True), style, marker="o", label=label)
        rw.plot(range(1, len(r["reward_curve"]) + 1), r["reward_curve"], style, label=label)
    ev.set(xlabel="policy version", ylabel="held-out greedy accuracy", title="eval")
    rw.set(xlabel="step", ylabel="mean reward of the batch", title="training reward")
    ev.legend(fontsize=7)
    fig.suptitle("SmolLM2-135M-Instruct, millstream on this machine (bench/learning/real_model.py)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog=PROG,
        description="A real model's held-out accuracy before and after training, per seed and variant.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ap.add_argument("--config", type=Path, default=CONFIG, help="the run's TOML config")
    ap.add_argument("--seeds", type=int, default=3, help="runs per variant")
    ap.add_argument("--first-seed", type=int, default=0, help="run.seed of the first (then +1, +2, ...)")
    ap.add_argument("--variants", default="full,lora", help=f"comma-separated, of {sorted(VARIANTS)}")
    ap.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="config override for every run"
    )
    ap.add_argument("--limit-min", type=float, default=45.0, help="stop a run after this many minutes")
    ap.add_argument("--sample-s", type=float, default=2.0, help="memory sampling period")
    ap.add_argument("--name", default="real-model", help="results file name (without .json)")
    ap.add_argument("--keep", action="store_true", help="keep the run directories (printed)")
    ns = ap.parse_args(argv)
    ns.variant_list = [v.strip() for v in ns.variants.split(",") if v.strip()]
    unknown = [v for v in ns.variant_list if v not in VARIANTS]
    if unknown or not ns.variant_list:
        ap.error(f"--variants: unknown {unknown}; choose from {sorted(VARIANTS)}")
    if ns.seeds < 1:
        ap.error("--seeds must be at least 1")
    return ns


def main(argv: list[str] | None = None) -> None:
    ns = parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="millstream-real-model-"))
    runs: list[dict] = []
    try:
        for seed in range(ns.first_seed, ns.first_seed + ns.seeds):
            order = ns.variant_list if seed % 2 == 0 else ns.variant_list[::-1]
            for variant in order:
                runs.append(_run_once(ns.config, variant, seed, ns.set, work, ns))
    finally:
        if ns.keep:
            print(f"run directories: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    out = results_dir()
    report = {
        "command": " ".join(
            ["python -m millstream.bench.learning.real_model", *(argv if argv is not None else sys.argv[1:])]
        ),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": machine(),
        "config": str(ns.config.relative_to(ROOT) if ns.config.is_relative_to(ROOT) else ns.config),
        "overrides": ns.set,
        "variants": {v: VARIANTS[v] for v in ns.variant_list},
        "by_variant": aggregate(runs),
        "runs": runs,
    }
    (out / f"{ns.name}.json").write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2))
    plot(runs, out / f"{ns.name}.png")
    for variant, row in report["by_variant"].items():
        rise = row.get("eval_rise", {})
        print(f"{variant}: eval rise median {_pct(rise.get('median'))} (range {_pct(rise.get('min'))} to "
              f"{_pct(rise.get('max'))}) over seeds {row['seeds']}")  # fmt: skip
    print(f"results: {out / (ns.name + '.json')}  plot: {out / (ns.name + '.png')}")


if __name__ == "__main__":
    main()
