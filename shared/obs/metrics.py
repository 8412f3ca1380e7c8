"""Metrics as JSON lines: one object per record, namespaced keys (`reward/mean`, `sync/total_s`).

orjson writes them (fast, and it takes numpy scalars). Each record gets `time` (Unix seconds) so
records of different processes can be merged. `NullMetrics` has the same methods and does
nothing, so callers never test `if metrics:`.

`LatencyHistogram` keeps latencies in fixed log-spaced buckets (about 4% wide), so a process
that serves millions of turns keeps a constant-size record, and the histograms of many workers
and intervals merge by adding counts; percentiles are read from it to within a bucket.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import orjson

from millstream.shared.obs.appendfile import AppendFile

__all__ = ["MetricsWriter", "NullMetrics", "read_jsonl", "step_records", "LatencyHistogram"]


class MetricsWriter:
    """Records appended to a JSONL file; a full disk costs records (`lost`), never the run
    (shared/obs/appendfile.py)."""

    def __init__(self, path: str | Path) -> None:
        self._file = AppendFile(path)
        self.path = self._file.path

    @property
    def lost(self) -> int:
        return self._file.lost

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(
            orjson.dumps(
                {"time": time.time(), **record},
                option=orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_NON_STR_KEYS | orjson.OPT_APPEND_NEWLINE,
            )
        )

    def position(self) -> int:
        """Bytes written so far (every record is on disk when `write` returns)."""
        return self._file.position()

    def close(self) -> None:
        self._file.close()


class NullMetrics:
    lost = 0

    def write(self, record: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """All records of a JSONL file (a torn last line, from a killed writer, is skipped)."""
    records = []
    for line in Path(path).read_bytes().splitlines():
        try:
            records.append(orjson.loads(line))
        except orjson.JSONDecodeError:
            continue
    return records


def step_records(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The training-step records among a run's metrics records (`read_jsonl`), in order, without
    the ones a resume rolled back: events, eval rounds and the summary left out."""
    return [r for r in records if "reward/mean" in r and not r.get("rolled_back")]


class LatencyHistogram:
    """Counts of durations in log-spaced buckets from `low_s` up; mergeable, constant memory.

    Bucket i holds [low_s * r**i, low_s * r**(i+1)) with r = 2**(1/16) (16 buckets per
    doubling, ~4.4% wide); durations below `low_s` land in bucket 0, above the last in the last.
    A percentile is reported as the geometric middle of its bucket.
    """

    PER_DOUBLING = 16

    def __init__(self, low_s: float = 1e-4, doublings: int = 24) -> None:
        self.low_s = low_s
        self.counts = [0] * (doublings * self.PER_DOUBLING)
        self.total = 0
        self.sum_s = 0.0

    def add(self, seconds: float) -> None:
        i = 0 if seconds <= self.low_s else int(math.log2(seconds / self.low_s) * self.PER_DOUBLING)
        self.counts[min(i, len(self.counts) - 1)] += 1
        self.total += 1
        self.sum_s += seconds

    def merge(self, other: LatencyHistogram) -> None:
        if (other.low_s, len(other.counts)) != (self.low_s, len(self.counts)):
            raise ValueError("histograms with different buckets cannot be merged")
        self.counts = [a + b for a, b in zip(self.counts, other.counts)]
        self.total += other.total
        self.sum_s += other.sum_s

    def percentile(self, q: float) -> float | None:
        """The q-th percentile (0..100), or None when empty."""
        if not self.total:
            return None
        rank = max(1, math.ceil(self.total * q / 100))
        seen = 0
        for i, count in enumerate(self.counts):
            seen += count
            if seen >= rank:
                return self.low_s * 2 ** ((i + 0.5) / self.PER_DOUBLING)
        raise AssertionError("unreachable: counts sum to total")

    def mean(self) -> float | None:
        return self.sum_s / self.total if self.total else None

    def to_dict(self) -> dict[str, Any]:
        """Sparse form for JSON: {"low_s", "n", "sum_s", "buckets": {index: count}}."""
        return {
            "low_s": self.low_s,
            "n": len(self.counts),
            "sum_s": self.sum_s,
            "buckets": {str(i): c for i, c in enumerate(self.counts) if c},
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LatencyHistogram:
        hist = cls(data["low_s"], data["n"] // cls.PER_DOUBLING)
        for i, c in data["buckets"].items():
            hist.counts[int(i)] = c
        hist.total = sum(hist.counts)
        hist.sum_s = data["sum_s"]
        return hist
