"""How fast `millstream inspect` answers on a large store: one episode, the list, the web page.

    python -m millstream.bench.inspect_speed [--episodes 10000] [--rounds 5]

A person opens a run's store to look at one episode: the wait they see is a whole command, a
fresh process included, so each sample is one: `inspect RUN --episode ROW` (an episode from the
middle of the store, turn by turn, decoded with `tokenizers`), `inspect RUN` (the newest
episodes as a list) and the page (`inspect RUN --serve` started, then the page, the episode
list and the counts fetched over HTTP, as the browser does first). The three alternate round by
round (bench/kit/rounds.py). The store is a `millstream stress --store` run of `--episodes`
echo episodes on the synthetic actor, made once. Goals (issue 25): the episode in under a second
and the page in under two, on a quiet machine.
"""

from __future__ import annotations

import argparse
import os
import select
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from millstream.bench.kit.rounds import compare, results_dir, write_outcome
from millstream.bench.kit.scratch import scratch
from millstream.bench.stress import run_stress, stress_parser
from millstream.bench.stress_suite import FAST_ENGINE

__all__ = ["main"]

MILLSTREAM = [sys.executable, "-m", "millstream.shared.launch.cli"]


def make_store(folder: Path, episodes: int) -> Path:
    """A stress run's folder with `episodes` episodes in its store.sqlite."""
    args = ["--env", "echo", "--episodes", str(episodes), "--concurrency", "1000", "--actor", "synthetic"]
    report = run_stress(stress_parser().parse_args([*args, *FAST_ENGINE, "--store", "--out", str(folder)]))
    if report["lost"] or report["store"]["written"] < episodes:
        raise RuntimeError(f"the store run lost episodes: {report['lost']}, wrote {report['store']}")
    return folder


def _timed(cmd: list[str]) -> dict[str, float]:
    started = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd} failed: {proc.stderr[-2000:]}")
    return {"wall_s": time.perf_counter() - started}


def _page(run_dir: Path) -> dict[str, float]:
    """From `--serve` starting to the page, the list and the counts answered."""
    started = time.perf_counter()
    proc = subprocess.Popen(
        [*MILLSTREAM, "inspect", str(run_dir), "--serve", "--port", "0"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 60)
        if not ready:
            raise TimeoutError("inspect --serve printed no address in 60 s")
        url = proc.stdout.readline().split()[2]  # "millstream inspect: http://host:port/  (...)"
        for path in ("", "api/episodes?limit=50", "api/counts"):
            with urllib.request.urlopen(url + path, timeout=60) as reply:
                reply.read()
        return {"wall_s": time.perf_counter() - started}
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m millstream.bench.inspect_speed", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--episodes", type=int, default=10000, help="episodes in the store")
    p.add_argument("--rounds", type=int, default=5)
    ns = p.parse_args(argv)
    with scratch("millstream-inspect-bench-") as folder:
        run_dir = make_store(folder / "run", ns.episodes)
        row = str(ns.episodes // 2)
        outcome = compare(
            {
                "episode": lambda: _timed([*MILLSTREAM, "inspect", str(run_dir), "--episode", row]),
                "list": lambda: _timed([*MILLSTREAM, "inspect", str(run_dir)]),
                "page": lambda: _page(run_dir),
            },
            rounds=ns.rounds,
            metric="wall_s",
        )
        store_mb = (run_dir / "store.sqlite").stat().st_size / 1e6
        extra = {"episodes": ns.episodes, "store_mb": store_mb, "load": os.getloadavg()[0]}
        path = write_outcome(outcome, results_dir(), "inspect-speed", extra=extra)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
