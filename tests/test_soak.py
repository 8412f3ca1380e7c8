"""The soak's short version (bench/soak): the real stack under chaos and attack.

The hour-long run is a benchmark (bench/README.md, "Soak"); this one proves the harness and
the run's healing in every `make test`: every kill healed, the accounting holds, the hostile
peer's probes all ran, and no role's open descriptors grew between the end of the first minute
and the end (memory is judged over the hour, where a slope means something).
"""

from __future__ import annotations

import os

import orjson
import pytest

from millstream.bench.soak.__main__ import main
from millstream.shared.process.allocator import find_tcmalloc


@pytest.mark.real
@pytest.mark.timeout(900)
def test_three_minutes_of_chaos_and_attack(tmp_path, tiny_model_dir):
    """Three minutes of training, a random role killed every 40 s (four or five kills), the
    hostile peer every 5 s. Four minutes took 4.5 of the suite's 25; the kills' spacing, not the
    length, is what could overlap a kill with a restart, and it is unchanged."""
    out = tmp_path / "soak"
    argv = ["--minutes", "3", "--sample-s", "10", "--kill-every-s", "40", "--warmup-min", "1"]
    argv += ["--process-warmup-min", "0.2"]  # a restarted process's first two samples
    argv += ["--model", tiny_model_dir, "--out", str(out)]
    assert main(argv) == 0, (out / "soak.json").read_text()[-4000:]
    report = orjson.loads((out / "soak.json").read_bytes())
    summary = report["summary"]
    assert summary["accounting_ok"] is True and summary["version"] > 0
    assert len(report["kills"]) >= 3 and sum(report["restarts"].values()) >= len(report["kills"])
    assert report["attacks_sent"]["huge_handshake"] >= 10 and report["actor_answers"]["not_learner"] > 0
    assert summary["messages_refused"].get("wrong_worker", 0) > 0  # the tools' key as worker 0
    for role, numbers in report["roles"].items():
        assert numbers["fds_last"] <= numbers["fds_first"] + 16, (role, numbers)
        assert 0 < numbers["pss_mib_last"] <= numbers["rss_mib_last"], (role, numbers)
    # The actor's tree split by process: its own and vLLM's engine processes, each with a slope.
    assert len(report["roles"]["actor"]["pss_mib_per_hour_by_process"]) >= 2, report["roles"]["actor"]
    assert (out / "soak.png").stat().st_size > 10_000
    # The vLLM actor runs under tcmalloc where the machine has it (shared/process/allocator.py).
    if find_tcmalloc() is not None:
        assert "memory allocator: " in (out / "run" / "logs" / "actor.log").read_text()


def test_growth_is_measured_within_each_process_of_a_role():
    from millstream.bench.soak.watch import slope_per_hour

    # Two processes of one role (a restart at minute 30), each flat: no growth, though the
    # samples fall from 500 to 100 MiB; each climbing 1 MiB a minute: 60 MiB an hour.
    flat = [(t, 500.0, 1) for t in range(10, 30)] + [(t, 100.0, 2) for t in range(30, 60)]
    assert slope_per_hour(flat) == 0.0
    climbing = [(t, 400.0 + t, 1) for t in range(10, 30)] + [(t, 70.0 + t, 2) for t in range(30, 60)]
    assert abs(slope_per_hour(climbing) - 60.0) < 1e-9
    assert slope_per_hour([(12.0, 5.0, 1)]) == 0.0


def test_memory_is_split_by_process_name():
    import subprocess

    from millstream.bench.kit.procstat import tree_pss_by_name, tree_pss_bytes

    child = subprocess.Popen(["sleep", "30"])
    try:
        parts = tree_pss_by_name(os.getpid())
        assert parts.get("sleep", 0) > 0 and len(parts) >= 2, parts  # this process and its child
        assert abs(sum(parts.values()) - tree_pss_bytes(os.getpid())) < 8 * 2**20
        assert tree_pss_by_name(child.pid).keys() == {"sleep"}
    finally:
        child.kill()
        child.wait()


def test_a_restarted_process_warms_up_before_its_growth_counts(tmp_path):
    from millstream.bench.soak.watch import Watch

    watch = Watch(tmp_path)
    # One process flat at 500 MiB from minute 10; its successor (a kill at 30) loads its model
    # in its first two minutes (100, then 480), then is flat at 500.
    series = [(float(t), 500.0, 20, 1, 500.0) for t in range(10, 30)]
    series += [(30.0, 100.0, 5, 2, 100.0), (31.0, 480.0, 20, 2, 480.0)]
    series += [(float(t), 500.0, 20, 2, 500.0) for t in range(32, 60)]
    watch.samples["actor"] = series
    watch.parts["actor"] = [(t, pid, {"python": pss}) for t, _, _, pid, pss in series]
    warm = watch.report(10, {}, process_warmup_min=2)["actor"]
    assert warm["pss_mib_per_hour"] == 0.0 and warm["pss_mib_per_hour_by_process"] == {"python": 0.0}
    assert watch.report(10, {}, process_warmup_min=0)["actor"]["pss_mib_per_hour"] > 100
