"""Metrics as JSON lines: one object per record, namespaced keys (`reward/mean`, `sync/total_s`).

orjson writes them (fast, and it takes numpy scalars). Each record gets `time` (Unix seconds) so
records of different processes can be merged. `NullMetrics` has the same methods and does
nothing, so callers never test `if metrics:`.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import orjson

__all__ = ["MetricsWriter", "NullMetrics", "read_jsonl"]


class MetricsWriter:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("ab")

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(orjson.dumps({"time": time.time(), **record},
                                      option=orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_APPEND_NEWLINE))
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class NullMetrics:
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
