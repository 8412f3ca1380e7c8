"""A benchmark's scratch folder: removed when the benchmark ends well, kept when it fails.

    with scratch("millstream-overhead-") as work:
        model = build_tiny_model(work / "tiny", seed=0)
        ...  # engine logs, keys, run folders go under `work`

What a benchmark writes there (a tiny model, keys, each engine's log, whole run folders) is
worth nothing once its numbers are in the results folder, and a benchmark run every hour left
a folder a run in /tmp. When it fails, the logs are the only account of why: the folder stays,
and its path is printed.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["scratch"]


@contextmanager
def scratch(prefix: str) -> Iterator[Path]:
    """A fresh folder in the system's temporary directory; gone after a clean exit."""
    work = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield work
    except BaseException:
        print(f"the benchmark failed; its logs are kept in {work}", file=sys.stderr, flush=True)
        raise
    shutil.rmtree(work, ignore_errors=True)
