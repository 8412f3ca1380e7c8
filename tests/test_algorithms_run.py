"""The learner suite end to end on the real stack: estimators learn, 2 ranks train, resume works.

Short runs against the session's actor (see conftest and helpers.millstream_run).
"""

import os
import signal
import subprocess

import pytest
from helpers import MILLSTREAM, ROOT, check_accounting, millstream_run, read_episodes, start_run, steps_of

from millstream.bench.learning.margins import CASES, rise
from millstream.shared.obs.metrics import read_jsonl
from millstream.shared.store.rundir import checkpoint_step, find_checkpoint

#: Each estimator's run length and the bar it must clear: the rise of the mean reward of the last
#: 4 steps over the first 4. Measured with `python -m millstream.bench.learning.margins --case NAME
#: --runs 10 --steps 16` (10 learners, 10 non-learners at learner.lr=1e-12, run.seed 0..9, one
#: real vLLM-CPU actor, the roles on their own cores as in the tests: shared/process/cpus.py;
#: bench/results/2026-11-27-vm/learning-margins-NAME.json, 2026-11-27 01:01-01:26 UTC), and put
#: in the gap (min, q1, median, q3, max):
#: - gigpo-multiturn at 14 steps: learners 0.141 / 0.252 / 0.428 / 0.467 / 0.516, non-learners
#:   -0.011 / -0.007 / -0.001 / 0.007 / 0.014. The bar, 0.05, is 3.6x the largest drift and 0.35x
#:   the smallest learner (measured before the core split: smallest learner 0.135).
#: - drgrpo at 16 steps: learners 0.112 / 0.237 / 0.334 / 0.419 / 0.486, non-learners
#:   -0.009 / -0.006 / -0.002 / 0.004 / 0.010. The bar, 0.05, is 5x the largest drift and 0.45x
#:   the smallest learner. At 14 steps (its length before) the smallest learner rose 0.091: the
#:   bar would sit at 0.55x it, too near.
RUNS = {"drgrpo": (16, 0.05), "gigpo-multiturn": (14, 0.05)}


@pytest.mark.parametrize("name", sorted(RUNS))
def test_estimator_learns(actor, tmp_path, name):
    """Each estimator makes the policy better within its steps, by a margin a non-learner's
    drift never reaches (RUNS: measured distributions)."""
    steps, bar = RUNS[name]
    run_dir = tmp_path / "run"
    millstream_run(actor, run_dir, f"train.steps={steps}", *CASES[name])  # the measured settings
    check_accounting(run_dir)
    assert rise(run_dir / "metrics.jsonl") >= bar, [round(r["reward/mean"], 3) for r in steps_of(run_dir)]


def test_two_rank_zero3_learner(actor, tmp_path):
    run_dir = tmp_path / "run"
    millstream_run(actor, run_dir, "train.steps=4", "learner.ranks=2", "learner.zero_stage=3")
    summary = check_accounting(run_dir)
    assert summary["version"] == 4
    steps = steps_of(run_dir)
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    # Both ranks trained: the step's (global) sequence count is the whole batch, split in two.
    assert all(r["learner/ranks"] == 2 for r in steps)
    assert all(r["train/sequences"] == r["batch/episodes"] for r in steps)


def test_sigkill_then_resume_continues_the_run_in_its_directory(actor, tmp_path):
    run_dir = tmp_path / "run"
    cmd = [f"actor.connect={actor.address}", f"model.path={actor.model_dir}"]
    proc = start_run(
        run_dir,
        *cmd,
        "train.steps=12",
        "learner.checkpoint_every=2",
        "run.max_restarts=0",
        until="step    5/",
    )
    os.kill(int((run_dir / "learner.pid").read_text()), signal.SIGKILL)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 1 and "learner failed: killed by SIGKILL" in out
    assert f"resume with: millstream run run.resume={run_dir.resolve()}" in out
    killed_at = max(r["step"] for r in read_jsonl(run_dir / "metrics.jsonl") if "reward/mean" in r)
    assert killed_at >= 5
    # The trajectory store holds every episode the metrics count, even after a kill.
    last = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "reward/mean" in r][-1]
    records = read_episodes(run_dir)
    assert sum(r["fate"] == "trained" for r in records) >= last["episodes/trained"]

    # A resume that changes the environment or the learning rate is refused before anything starts.
    changed = subprocess.run(
        [
            *MILLSTREAM,
            "run",
            *cmd,
            "train.steps=8",
            f"run.resume={run_dir}",
            "learner.lr=0.1",
            "envpool.env=echo",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert changed.returncode == 2
    assert "envpool.env: 'evenchars' -> 'echo'" in changed.stderr
    assert "learner.lr: 0.004 -> 0.1" in changed.stderr

    # Resuming continues in the same directory from the latest checkpoint (step 4).
    ckpt = checkpoint_step(find_checkpoint(run_dir))
    assert ckpt in (4, 6)
    resumed = millstream_run(actor, run_dir, "train.steps=8", f"run.resume={run_dir}")
    assert "records after it marked rolled back" in resumed.stdout
    steps = steps_of(run_dir)
    assert [r["step"] for r in steps] == list(range(1, 9))  # rolled-back steps 5.. are marked
    assert steps[ckpt]["trained_version"] == ckpt
    # The run's clock goes on across the resume, and the checkpoint resumed from stands.
    assert steps[ckpt]["perf/elapsed_s"] > steps[ckpt - 1]["perf/elapsed_s"]
    events = read_jsonl(run_dir / "metrics.jsonl")
    assert [
        r.get("rolled_back", False) for r in events if r.get("event") == "checkpoint" and r["step"] == ckpt
    ] == [False]
    rolled = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r.get("rolled_back")]
    assert {r["step"] for r in rolled if "reward/mean" in r} == set(range(ckpt + 1, killed_at + 1))
    summary = check_accounting(run_dir)  # the whole run adds up, earlier session included
    assert summary["version"] == 8 and summary["learner_sessions"] == 2
    assert "over 2 learner sessions" in resumed.stdout and "accounting ok" in resumed.stdout
    trained = [r for r in read_episodes(run_dir) if r["fate"] == "trained" and not r["rolled_back"]]
    assert len({r["episode_id"] for r in trained}) == len(trained)  # nothing trained twice

    # A finished run says so and starts nothing.
    size = (run_dir / "metrics.jsonl").stat().st_size
    again = subprocess.run(
        [*MILLSTREAM, "run", f"run.resume={run_dir}", "train.steps=8"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert again.returncode == 0
    assert again.stdout.startswith(f"millstream run: {run_dir.resolve()} already finished")
    assert (run_dir / "metrics.jsonl").stat().st_size == size

    # A finished run trains further when asked, and the whole run still adds up.
    further = millstream_run(actor, run_dir, "train.steps=10", f"run.resume={run_dir}")
    assert "accounting ok" in further.stdout
    assert [r["step"] for r in steps_of(run_dir)] == list(range(1, 11))
    summary = check_accounting(run_dir)
    assert summary["version"] == 10


def test_decoupled_policy_trains_stale_groups_with_capped_weights(actor, tmp_path):
    """staleness_policy=decoupled keeps groups beyond max_staleness (up to its own bound) and
    trains them with decoupled PPO; the run reports importance-weight statistics."""
    run_dir = tmp_path / "run"
    millstream_run(
        actor,
        run_dir,
        "train.steps=5",
        "train.max_staleness=0",
        "envpool.admission_slack=2",
        "learner.staleness_policy=decoupled",
        "learner.decoupled_max_staleness=3",
        "train.groups_per_batch=2",
        "train.group_size=4",
    )
    summary = check_accounting(run_dir)
    assert "stale" not in summary["episodes_dropped"]
    steps = steps_of(run_dir)
    assert max(r["staleness/max"] for r in steps) >= 1  # stale groups were trained, not dropped
    assert all(r["staleness/max"] <= 3 for r in steps)
    for r in steps:
        assert r["train/is_weight_mean"] > 0 and r["train/is_weight_max"] > 0
        assert 0 <= r["train/is_capped_frac"] <= 1
