"""Compare systems round by round in one run, and record the result where the README points.

    from millstream.bench.kit.rounds import compare, Outcome, results_dir, write_outcome

    outcome = compare({"millstream": run_ours, "asyncllm": run_engine}, rounds=3, metric="tokens_s")
    write_outcome(outcome, results_dir(), "overhead-c64")   # overhead-c64.json + .png

Why rounds: on a shared machine the load changes minute to minute. Running A's three repeats,
then B's, puts a load change between the systems and calls it a difference. Interleaving (A, B, A,
B, ...) puts every system through the same minutes, and the ratio of medians is what survives.
The order inside a round alternates too (A, B then B, A), so neither system always runs first,
warm or cold.

A measurement function takes no argument and returns a dict of numbers (its own metrics: tokens/s,
p99 latency, memory, ...). `compare` keeps every sample, and reports per metric the median and
the spread (min, max) over the rounds, and for `metric` the ratio of each system's median to the
first system's (the reference), with the ratio of each round's pair (`paired_ratios`: its
median and range). Results go to `bench/results/<date>-<host>/<name>.json` with
the command that made them, and a PNG of the samples per round.
"""

from __future__ import annotations

import datetime
import platform
import shlex
import socket
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

__all__ = ["Outcome", "compare", "pooled", "spread", "results_dir", "write_outcome", "machine"]

RESULTS = Path(__file__).resolve().parent.parent / "results"  # bench/results


@dataclass
class Outcome:
    """Every sample of every system, by round; `metric` is the one the ratios are taken of."""

    metric: str
    samples: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    settings: dict[str, Any] = field(default_factory=dict)

    def median(self, system: str, metric: str | None = None) -> float:
        return statistics.median(s[metric or self.metric] for s in self.samples[system])

    def ratios(self) -> dict[str, float]:
        """Each system's median of `metric` over the first system's (the reference)."""
        reference = next(iter(self.samples))
        base = self.median(reference)
        return {name: (self.median(name) / base if base else float("nan")) for name in self.samples}

    def paired_ratios(self) -> dict[str, list[float]]:
        """Each system's `metric` over the reference's in the same round, round by round.

        The ratio of medians compares each system's typical round; these pair every sample
        with the reference's of the same minutes, so a drift of the machine across the run
        cancels inside each pair, and their spread is the noise a ratio of this run carries."""
        reference = next(iter(self.samples))
        base = [s[self.metric] for s in self.samples[reference]]
        return {
            name: [s[self.metric] / b if b else float("nan") for s, b in zip(rows, base, strict=True)]
            for name, rows in self.samples.items()
        }

    def summary(self) -> dict[str, Any]:
        return {
            "metric": self.metric,
            "reference": next(iter(self.samples), None),
            "ratios": self.ratios(),
            "paired_ratios": {name: spread(r) for name, r in self.paired_ratios().items() if r},
            "systems": {
                name: {key: spread([s[key] for s in rows]) for key in rows[0] if _numeric(rows[0][key])}
                for name, rows in self.samples.items()
                if rows
            },
        }


def _numeric(value: Any) -> bool:
    return isinstance(value, (int, float))  # a bool too, as float() always took it


def spread(values: list[float]) -> dict[str, float]:
    """Median and range of a metric over rounds (n is small: quartiles would say nothing more)."""
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "n": len(values),
    }


def compare(
    systems: dict[str, Callable[[], dict[str, Any]]],
    *,
    rounds: int,
    metric: str,
    settings: dict[str, Any] | None = None,
    say: Callable[[str], None] = print,
    warmup: bool = False,
) -> Outcome:
    """Run every system once per round, alternating the order round to round.

    `warmup` runs each system once first and discards it: an engine's first batches of a new
    size build their kernels (oneDNN primitives on CPU), which would land on round 1 only.
    """
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    outcome = Outcome(metric=metric, samples={name: [] for name in systems}, settings=dict(settings or {}))
    names = list(systems)
    for name in names if warmup else []:
        say(f"warm-up {name}: {metric} {systems[name]()[metric]:.4g} (not counted)")
    for round_ in range(rounds):
        order = names if round_ % 2 == 0 else names[::-1]
        for name in order:
            sample = systems[name]()
            if metric not in sample:
                raise KeyError(f"system {name!r} returned no {metric!r}: {sorted(sample)}")
            # Numbers are summarized over rounds; anything else (a breakdown) is kept as it came.
            outcome.samples[name].append({k: float(v) if _numeric(v) else v for k, v in sample.items()})
            say(f"round {round_ + 1}/{rounds} {name}: {metric} {sample[metric]:.4g}")
    return outcome


def pooled(outcomes: list[Outcome]) -> Outcome:
    """Several runs of one comparison as one outcome: each system's samples in run order, so
    every round keeps its pair. The runs must compare the same systems on the same metric."""
    first = outcomes[0]
    if any(o.metric != first.metric or list(o.samples) != list(first.samples) for o in outcomes):
        raise ValueError("pooled outcomes must compare the same systems on the same metric")
    samples = {name: [s for o in outcomes for s in o.samples[name]] for name in first.samples}
    return Outcome(metric=first.metric, samples=samples, settings={**first.settings, "runs": len(outcomes)})


def machine() -> dict[str, Any]:
    """What the numbers were measured on."""
    import os

    return {
        "host": socket.gethostname(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "load_avg": list(os.getloadavg()),
    }


def results_dir(root: Path | None = None) -> Path:
    """`bench/results/<date>-<host>/`, made if missing."""
    day = datetime.date.today().isoformat()
    path = (root or RESULTS) / f"{day}-{socket.gethostname()}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def write_outcome(outcome: Outcome, folder: Path, name: str, extra: dict[str, Any] | None = None) -> Path:
    """`<name>.json` (settings, machine, command, every sample, the summary) and `<name>.png`."""
    payload = {
        "name": name,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": shlex.join([Path(sys.executable).name, *sys.argv]),
        "machine": machine(),
        "settings": outcome.settings,
        "summary": outcome.summary(),
        "samples": outcome.samples,
        **(extra or {}),
    }
    folder.mkdir(parents=True, exist_ok=True)  # `--out` may name a folder not made yet
    path = folder / f"{name}.json"
    path.write_bytes(orjson.dumps(payload, option=orjson.OPT_INDENT_2))
    _plot(outcome, folder / f"{name}.png", name)
    return path


def _plot(outcome: Outcome, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, rows in outcome.samples.items():
        values = [r[outcome.metric] for r in rows]
        ax.plot(
            range(1, len(values) + 1),
            values,
            marker="o",
            label=f"{name} (median {statistics.median(values):.4g})",
        )
    ax.set_xlabel("round")
    ax.set_ylabel(outcome.metric)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
