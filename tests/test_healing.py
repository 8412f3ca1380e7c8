"""A run heals (shared/launch/healing.py): the launcher restarts an envpool worker, the actor and the
learner, each killed once with SIGKILL; nothing is lost, and every episode the dead processes
left behind is counted by cause (`worker_lost`), and what reached the dead learner after its
checkpoint is pushed again by the workers (no `learner_lost`). The actor here is the synthetic
one (the restart path is the same for vLLM; its start-up takes a minute on this CPU); the
learner is real.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import orjson
import pytest
from helpers import check_accounting, live_turns, read_episodes, start_run, steps_of

from millstream.envpool.lineage import read_lineage
from millstream.shared.process.lifecycle import run_processes


def _kill(run_dir: Path, name: str) -> int:
    pid = int((run_dir / f"{name}.pid").read_text())
    os.killpg(pid, signal.SIGKILL)  # the role and every process it started
    return pid


def _wait_for_step(run_dir: Path, step: int, proc: subprocess.Popen, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not steps_of(run_dir) or steps_of(run_dir)[-1]["step"] < step:
        assert proc.poll() is None, "the run ended early"
        assert time.monotonic() < deadline, f"no step {step} in {timeout_s}s"
        time.sleep(0.2)


def _wait_for_live_turns(run_dir: Path, proc: subprocess.Popen, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not live_turns(run_dir):
        assert proc.poll() is None, "the run ended early"
        assert time.monotonic() < deadline, "no turn was ever live on the actor"
        time.sleep(0.02)


@pytest.mark.real
def test_each_role_killed_once_is_restarted_and_nothing_is_lost(tiny_model_dir, tmp_path):
    run_dir = tmp_path / "run"
    proc = start_run(
        run_dir,
        "actor.kind=synthetic",
        f"model.path={tiny_model_dir}",
        "train.steps=40",
        "learner.checkpoint_every=5",
        "train.group_size=4",
        "train.groups_per_batch=2",
        "envpool.workers=2",
        "run.restart_backoff_s=0.2",
        # Turns of about 0.25 s (24 tokens at 10 ms), statistics every 0.1 s: the actor is killed
        # while it holds turns (at 2 ms a token it was often idle between steps, and a run had
        # nothing to retry).
        "actor.synthetic_step_s=0.01",
        "envpool.stats_every_s=0.1",
        until="step    3/",
    )
    worker_pid = _kill(run_dir, "envpool-0")
    _wait_for_step(run_dir, 12, proc)
    _wait_for_live_turns(run_dir, proc)
    actor_pid = _kill(run_dir, "actor")
    _wait_for_step(run_dir, 22, proc)
    learner_pid = _kill(run_dir, "learner")
    out, _ = proc.communicate(timeout=400)
    assert proc.returncode == 0, out[-3000:]
    assert "envpool-0 died (killed by SIGKILL); restarting it" in out
    assert "actor died (killed by SIGKILL); restarting it" in out
    assert "learner died (killed by SIGKILL); restarting it" in out
    assert int((run_dir / "learner.pid").read_text()) != learner_pid
    assert int((run_dir / "envpool-0.pid").read_text()) != worker_pid
    assert int((run_dir / "actor.pid").read_text()) != actor_pid

    summary = check_accounting(run_dir, workers=2)
    assert summary["accounting_ok"] and summary["worker_restarts"] == 1
    assert summary["learner_sessions"] == 2  # resumed from step 20, the later steps rolled back
    # Lost with worker 0: its open groups' members by id, and what it announced that the learner
    # never heard of (in its queues at the kill), counted from its lineage file (no ids).
    lost = summary["worker_lost"] + summary["worker_lost_unheard"]
    assert summary["episodes_failed"].get("worker_lost", 0) == lost
    assert summary["open_groups"] == 0
    # Every process's count is in its index's lineage file: together, every episode started.
    lineages = [read_lineage(run_dir / f"envpool-w{w}.lineage") for w in (0, 1)]
    assert [len(line) for line in lineages] == [2, 1], lineages
    assert summary["episodes_started"] == sum(p.announced for line in lineages for p in line)
    # What reached the dead learner after its checkpoint was pushed again by the workers that
    # kept it (envpool/redelivery.py): nothing is learner_lost, and nothing of the abandoned
    # timeline is refused for its versions: relabeled, it is trained or dropped as stale.
    assert "learner_lost" not in summary["episodes_failed"], summary["episodes_failed"]
    assert "incomplete_at_resume" not in summary["episodes_dropped"]  # partial groups came back
    assert "version" not in summary["messages_refused"], summary["messages_refused"]
    envpool_log = "".join((run_dir / "logs" / f"envpool-{w}.log").read_text() for w in (0, 1))
    assert re.search(r"pushed \d+ results again to learner session", envpool_log)
    # Turns in flight on the dead actor were retried at once (the connection dropped), not
    # after envpool.turn_timeout_s (120 s), and none of their episodes failed for it.
    assert not {"actor_timeout", "actor_lost"} & set(summary["episodes_failed"])
    stats = [orjson.loads(line) for line in (run_dir / "envpool-w1.jsonl").read_bytes().splitlines()]
    assert stats[-1]["client"]["disconnects"] >= 1
    steps = steps_of(run_dir)
    assert [s["step"] for s in steps] == list(range(1, 41))  # no step lost or repeated
    learner_log = (run_dir / "logs" / "learner.log").read_text()
    # The restarted actor was attached again and given the current weights (not version 0)
    # before it was announced, and it ends holding the learner's final weights.
    rejoined = re.findall(r"weight group of 1 replicas \(actor\) at version (\d+)", learner_log)
    assert len(rejoined) >= 2 and int(rejoined[1]) > 0, rejoined
    assert summary["replica_weights"]["actor"]["matches"] is True
    # The dead actor's live turns were retried: by whichever worker held turns at the kill (a
    # 2026-11-26 run had all three on the restarted worker 0 and none on worker 1).
    last = [orjson.loads((run_dir / f"envpool-w{w}.jsonl").read_bytes().splitlines()[-1]) for w in (0, 1)]
    assert sum(r["client"]["retries_by_cause"].get("actor_lost", 0) for r in last) >= 1, last
    assert run_processes(run_dir) == []
    lost = [r for r in read_episodes(run_dir) if r["cause"] == "worker_lost"]
    assert len(lost) == summary["worker_lost"]
