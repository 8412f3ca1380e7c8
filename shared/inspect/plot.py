"""`millstream plot RUN_DIR [--out DIR]`: the run's curves as PNGs, from its metrics.jsonl.

One PNG per panel (reward, eval, entropy, grad norm, staleness, throughput, lengths), each
series against the training step. Only per-step records are plotted (event records and the
summary are not curves), and records a resume rolled back are skipped (shared/store/rundir.py marks
them). A panel whose keys the run never wrote (no eval configured, say) is skipped with a line
saying so. matplotlib draws off-screen (Agg), so this works on a headless machine.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from millstream.shared.obs.metrics import read_jsonl

__all__ = ["PANELS", "plot_run", "main"]

#: Panel name -> (title, y label, regex of the metric keys it draws).
PANELS: dict[str, tuple[str, str, str]] = {
    "reward": ("Reward", "reward", r"^reward/(mean|min|max)$"),
    "eval": ("Evaluation", "rate", r"^eval/(reward_mean|success|pass@\d+)$"),
    "entropy": ("Policy entropy", "nats / token", r"^train/entropy$"),
    "grad_norm": ("Gradient norm (before clipping)", "norm", r"^train/grad_norm$"),
    "staleness": ("Staleness of trained tokens", "policy versions", r"^staleness/(mean|max)$"),
    "throughput": ("Throughput (trained tokens)", "tokens / s", r"^perf/tokens_per_s$"),
    "lengths": ("Response length (generated tokens per episode)", "tokens", r"^episode/response_len/"),
    "episodes": ("Episode rates", "fraction", r"^episode/(success_rate|invalid_action_rate|truncated_rate)$"),
}


def _series(records: list[dict], pattern: str) -> dict[str, tuple[list[int], list[float]]]:
    """Every numeric key matching `pattern`: (steps, values), in step order."""
    found: dict[str, tuple[list[int], list[float]]] = {}
    regex = re.compile(pattern)
    for record in records:
        for key, value in record.items():
            if regex.search(key) and isinstance(value, int | float) and not isinstance(value, bool):
                steps, values = found.setdefault(key, ([], []))
                steps.append(int(record["step"]))
                values.append(float(value))
    return found


def _step_records(path: Path) -> list[dict]:
    return sorted(
        (
            r
            for r in read_jsonl(path)
            if "step" in r and "event" not in r and "summary" not in r and not r.get("rolled_back")
        ),
        key=lambda r: r["step"],
    )


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> tuple[list[Path], list[str]]:
    """Writes the PNGs; returns (files written, names of panels skipped for lack of data)."""
    run_dir = Path(run_dir)
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{run_dir}: no metrics.jsonl here (is it a run directory?)")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    records = _step_records(path)
    out_dir = Path(out) if out else run_dir / "plots"
    out_dir.mkdir(parents=True, exist_ok=True)
    written, skipped = [], []
    for name, (title, ylabel, pattern) in PANELS.items():
        series = _series(records, pattern)
        if not series:
            skipped.append(name)
            continue
        fig, ax = plt.subplots(figsize=(7, 4))
        for key, (steps, values) in sorted(series.items()):
            ax.plot(steps, values, marker="." if len(steps) < 50 else None, label=key)
        ax.set(title=title, xlabel="training step", ylabel=ylabel)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
        fig.tight_layout()
        target = out_dir / f"{name}.png"
        fig.savefig(target, dpi=100)
        plt.close(fig)
        written.append(target)
    return written, skipped


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="millstream plot", description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", help="a run directory (holds metrics.jsonl)")
    parser.add_argument("--out", default=None, help="folder for the PNGs (default: RUN_DIR/plots)")
    args = parser.parse_args(argv)
    try:
        written, skipped = plot_run(args.run_dir, args.out)
    except FileNotFoundError as exc:
        print(f"millstream plot: {exc}", file=sys.stderr)
        return 2
    for name in skipped:
        print(f"skipped {name}: no {PANELS[name][2]} keys in metrics.jsonl")
    for target in written:
        print(f"wrote {target}")
    return 0
