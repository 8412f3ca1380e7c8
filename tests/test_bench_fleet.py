"""bench/fleet.py runs end to end at minimal sizes. Its numbers are not checked here: benchmarks
measure (bench/README.md records them), tests assert behaviour."""

from __future__ import annotations

import orjson
import pytest

from millstream.bench.fleet import main


@pytest.mark.real
def test_the_fleet_benchmark_runs_and_writes_its_results(tmp_path):
    results = main(
        ["--replicas", "1,2", "--sync-replicas", "2", "--step-s", "0.02", "--episodes", "8"]
        + ["--warmup", "0.2", "--duration", "0.5", "--overhead-turns", "20", "--repeats", "2"]
        + ["--pushes", "1", "--big-mb", "1", "--rounds", "1", "--out", str(tmp_path)]
    )
    assert (tmp_path / "fleet-throughput-20ms.json").exists()  # every sample, by round
    assert orjson.loads((tmp_path / "fleet.json").read_bytes())["args"]["replicas"] == [1, 2]
    assert (tmp_path / "fleet.png").stat().st_size > 0
    assert [(r["replicas"], r["retries_by_cause"]) for r in results["throughput"]] == [(1, {}), (2, {})]
    (sync,) = results["sync"]
    assert sync["replicas"] == 2 and sync["push"]["random-1MB"]["bytes"] == 16 * (2**20 // 64) * 4
    assert set(results["overhead"]) >= {"wall_us", "cpu_us", "blocks"}
