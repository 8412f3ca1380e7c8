"""A run with several actor replicas (`actor.replicas`), through `millstream run`: they share the
work and hold the learner's weights; one killed midway comes back at the current version with
nothing lost; one started by hand joins a running run and drains on SIGTERM.

The replicas here are synthetic (actor/synthetic.py: the fleet's rules do not depend on the
engine, and two vLLM engines take minutes to start on this CPU); they join the weight group and
receive every broadcast for real, and keep a digest of what they received. The learner is real.
tests/test_fleet_vllm.py runs two vLLM replicas.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest
from helpers import KEYS, ROOT, check_accounting, live_turns, start_run, steps_of, wait_for_file

from millstream.bench.kit.spawn import spawn, stop
from millstream.shared.obs.metrics import read_jsonl
from millstream.shared.process.lifecycle import run_processes

pytestmark = pytest.mark.real  # the learner is DeepSpeed

KILL_AT = 12  # the step at which a replica is killed
SYNTHETIC = ("actor.kind=synthetic", "actor.synthetic_step_s=0.004", "train.group_size=4")


def _router_stats(run_dir: Path) -> dict[str, dict]:
    """Per replica, summed over the workers' last statistics records."""
    total: dict[str, dict] = {}
    for path in run_dir.glob("envpool-w*.jsonl"):
        last = read_jsonl(path)[-1]["client"]["replicas"]
        for name, stats in last.items():
            into = total.setdefault(name, {"requests": 0, "tokens": 0, "lost": 0})
            for key in into:
                into[key] += stats[key]
    return total


def _wait_for_step(run_dir: Path, step: int, proc: subprocess.Popen, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while not steps_of(run_dir) or steps_of(run_dir)[-1]["step"] < step:
        assert proc.poll() is None, "the run ended early"
        assert time.monotonic() < deadline, f"no step {step} in {timeout_s}s"
        time.sleep(0.2)


def _retries(run_dir: Path) -> dict[str, int]:
    out: dict[str, int] = {}
    for path in run_dir.glob("envpool-w*.jsonl"):
        for cause, n in read_jsonl(path)[-1]["client"]["retries_by_cause"].items():
            out[cause] = out.get(cause, 0) + n
    return out


def test_two_replicas_share_the_work_and_hold_the_learners_weights(tiny_model_dir, tmp_path):
    run_dir = tmp_path / "run"
    proc = start_run(
        run_dir, *SYNTHETIC, f"model.path={tiny_model_dir}", "actor.replicas=2", "train.steps=30"
    )
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-3000:]
    summary = check_accounting(run_dir)
    weights = summary["replica_weights"]
    assert weights["actor"]["matches"] is True and weights["actor-1"]["matches"] is True
    assert weights["actor"]["version"] == weights["actor-1"]["version"] == 30
    stats = _router_stats(run_dir)
    tokens = stats["actor"]["tokens"] + stats["actor-1"]["tokens"]
    assert min(stats["actor"]["tokens"], stats["actor-1"]["tokens"]) >= 0.3 * tokens, stats
    last = steps_of(run_dir)[-1]
    assert last["fleet/up"] == 2 and last["sync/replicas"] == 2
    assert "replicas 2/2" in out  # the step line says how many serve


def test_a_replica_killed_midway_comes_back_at_the_current_version(tiny_model_dir, tmp_path):
    run_dir = tmp_path / "run"
    proc = start_run(
        run_dir,
        *SYNTHETIC,
        f"model.path={tiny_model_dir}",
        "actor.replicas=2",
        # Killed at step 12 of 30 (was 20 of 50): back and regrouped at version 14 here
        # (2026-11-26, 57 s for the test, was 83 s); 16 steps leave room for a slow box.
        "train.steps=30",
        "run.restart_backoff_s=0.5",
        "actor.synthetic_step_s=0.04",  # turns of about a second: the victim holds some
        "envpool.stats_every_s=0.2",
    )
    _wait_for_step(run_dir, KILL_AT, proc)
    deadline = time.monotonic() + 60
    while live_turns(run_dir, "actor-1") == 0:  # killed while it serves: its turns must move
        assert time.monotonic() < deadline, "actor-1 never held a live turn"
        time.sleep(0.05)
    dead = int((run_dir / "actor-1.pid").read_text())
    os.killpg(dead, signal.SIGKILL)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-3000:]
    assert "actor-1 died (killed by SIGKILL); restarting it" in out
    assert int((run_dir / "actor-1.pid").read_text()) != dead
    summary = check_accounting(run_dir)
    assert not [cause for cause in summary["episodes_failed"] if cause.startswith("actor")]  # 0 lost
    assert _retries(run_dir).get("actor_lost", 0) >= 1  # its turns went to the other replica
    # Back in the group at a version > 0, and it ends holding the learner's final weights.
    log = (run_dir / "logs" / "learner.log").read_text()
    regroups = [int(v) for v in re.findall(r"replicas \(actor, actor-1\) at version (\d+)", log)]
    assert len(regroups) >= 2 and regroups[-1] >= KILL_AT, regroups
    assert summary["replica_weights"]["actor-1"]["matches"] is True
    stats = _router_stats(run_dir)
    assert stats["actor-1"]["tokens"] > 0 and stats["actor-1"]["lost"] >= 1
    assert run_processes(run_dir) == []


def test_a_replica_joins_a_running_run_and_drains_on_sigterm(tiny_model_dir, tmp_path):
    run_dir = tmp_path / "run"
    proc = start_run(
        run_dir,
        *SYNTHETIC,
        f"model.path={tiny_model_dir}",
        # Joined at step 5 and drained by step 9 here (1.6 s a step, 2026-11-26): 24 steps leave
        # a slow box more than twice the room (the replica's start-up and the steps slow alike).
        "train.steps=24",
        "actor.synthetic_step_s=0.02",  # slow enough that the joined replica is needed
        "actor.max_num_seqs=8",
    )
    ready = tmp_path / "joined.json"
    with (tmp_path / "joined.log").open("wb") as joined_log:
        joined = spawn(  # a group of its own, in this session, as the launcher places a role
            [sys.executable, "-m", "millstream.actor", "--join", str(run_dir), "--name", "spot-1"]
            + ["--ready-file", str(ready), KEYS],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=joined_log,
        )
    try:
        wait_for_file(ready, joined, 60, "the joining replica", log=tmp_path / "joined.log")
        log = run_dir / "logs" / "learner.log"
        deadline = time.monotonic() + 60
        while "(actor, spot-1)" not in log.read_text():
            assert time.monotonic() < deadline, "the learner never took the joining replica"
            time.sleep(0.2)
        joined_at = steps_of(run_dir)[-1]["step"]
        deadline = time.monotonic() + 60
        while _router_stats(run_dir).get("spot-1", {}).get("tokens", 0) == 0:
            assert time.monotonic() < deadline, "no turn went to the joined replica"
            time.sleep(0.5)
        joined.send_signal(signal.SIGTERM)
        assert joined.wait(timeout=60) != 0  # stopped by a signal (exit status STOPPED)
    finally:
        stop(joined, grace_s=0)  # whatever of its group is left (nothing, when it drained)
    drained = (tmp_path / "joined.log").read_text()
    assert "replica spot-1 drained" in drained, drained[-2000:]
    out, _ = proc.communicate(timeout=400)
    assert proc.returncode == 0, out[-3000:]
    summary = check_accounting(run_dir)
    assert not [cause for cause in summary["episodes_failed"] if cause.startswith("actor")]
    assert joined_at < 24
    spot = _router_stats(run_dir)["spot-1"]
    assert spot["tokens"] > 0
    weights = orjson.loads((run_dir / "summary.json").read_bytes())["replica_weights"]
    assert "spot-1" not in weights  # it left: only the replicas still up are asked
