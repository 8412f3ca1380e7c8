"""Disk trouble: a run directory that fills up, and a checkpoint cut off mid-write.

What is documented (learner/persist/checkpoint.py, shared/obs/appendfile.py, docs/running.md):
on a full disk a checkpoint fails cleanly (its partial folder removed, `latest` unchanged) and a
one-rank learner trains on, trying again at the next interval; metrics and episode lines that
cannot be written are counted, never half-kept; the store counts the episodes it could not
write. Nothing already written is lost, and a resume picks the last complete checkpoint.

The full disks are real: a small tmpfs mounted for the test (root only, as on this project's
machines; skipped otherwise).
"""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import orjson
import pytest
from helpers import start_run

from millstream.shared.obs.appendfile import AppendFile
from millstream.shared.obs.metrics import read_jsonl
from millstream.shared.store.rundir import STATE_FILE, find_checkpoint

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounts a small tmpfs (root only)")


@contextmanager
def small_disk(where: Path, mb: int) -> Iterator[Path]:
    where.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={mb}m", "tmpfs", str(where)], check=True)
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def fill(disk: Path) -> Path:
    """Take every free byte of `disk` with one file; returns it (delete it to free them)."""
    filler = disk / "filler"
    with open(filler, "wb", buffering=0) as f:
        for size in (2**20, 4096, 1):
            try:
                while True:
                    f.write(b"\0" * size)
            except OSError:
                continue
    return filler


def test_lines_on_a_full_disk_are_counted_and_the_file_stays_readable(tmp_path):
    with small_disk(tmp_path / "disk", 1) as disk:
        lines = AppendFile(disk / "metrics.jsonl")
        written = [orjson.dumps({"n": n}) + b"\n" for n in range(5)]
        assert all(lines.write(line) for line in written)
        filler = fill(disk)
        long = orjson.dumps({"n": 5, "pad": "x" * 20_000}) + b"\n"  # more than any page left
        assert not lines.write(long) and not lines.write(orjson.dumps({"n": 6}) + b"\n")
        assert lines.lost == 2
        filler.unlink()
        assert lines.write(orjson.dumps({"n": 7}) + b"\n")
        lines.close()
        # The lines before the disk filled are all there; a line cut short, if any, is ended
        # and skipped; nothing the disk refused appears half-written in another.
        assert [r["n"] for r in read_jsonl(disk / "metrics.jsonl")] == [0, 1, 2, 3, 4, 7]


@pytest.mark.real
def test_a_checkpoint_on_a_full_disk_fails_cleanly_and_the_next_succeeds(tiny_model_dir, tmp_path):
    from samples import random_samples

    from millstream.learner.persist.checkpoint import CheckpointFailed, load_checkpoint, save_checkpoint
    from millstream.learner.replay import ReplayBuffer
    from millstream.learner.train.trainer import Trainer
    from millstream.shared.config import LearnerConfig

    cfg = LearnerConfig(lr=1e-2, micro_batch_size=2, zero_stage=2)
    trainer, buffer = Trainer(tiny_model_dir, cfg, seed=0), ReplayBuffer(2, 1, 2, 8)

    def step(seed: int) -> None:
        trainer.train_step(random_samples(3, seed, max_len=20), cfg, generation_budget=32)

    with small_disk(tmp_path / "disk", 48) as disk:
        run_dir = disk / "run"
        step(1)
        first = save_checkpoint(run_dir, trainer, buffer, {"n": 1}, keep=2)
        step(2)
        filler = fill(disk)
        with pytest.raises(CheckpointFailed, match=r"checkpoint step_000002 not saved: .* MiB free in "):
            save_checkpoint(run_dir, trainer, buffer, {"n": 2}, keep=2)
        names = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
        assert names == ["latest", "step_000001"]  # the partial folder is gone, latest unchanged
        assert find_checkpoint(run_dir) == first
        filler.unlink()
        step(3)
        third = save_checkpoint(run_dir, trainer, buffer, {"n": 3}, keep=2)
        assert find_checkpoint(run_dir) == third and third.name == "step_000003"
        # What was saved before the disk filled still loads.
        fresh = Trainer(tiny_model_dir, cfg, seed=0)
        assert load_checkpoint(first, fresh, ReplayBuffer(2, 1, 2, 8))["n"] == 1 and fresh.version == 1


def _lines_until(proc: subprocess.Popen, done, timeout_s: float = 300) -> list[str]:
    """The launcher's lines until `done(line)` (or it ends, or time runs out)."""
    seen: list[str] = []
    deadline = time.monotonic() + timeout_s
    assert proc.stdout is not None
    for line in proc.stdout:
        seen.append(line)
        if done(line) or time.monotonic() > deadline:
            break
    return seen


def _step(line: str) -> int:
    parts = line.split()
    return int(parts[1].split("/")[0]) if line.startswith("step ") and len(parts) > 1 else -1


def _latest(run_dir: Path) -> str:
    path = run_dir / "checkpoints" / "latest"
    return path.read_text().strip() if path.exists() else ""


@pytest.mark.real
def test_a_run_whose_disk_fills_trains_on_and_loses_nothing_it_wrote(tiny_model_dir, tmp_path):
    with small_disk(tmp_path / "disk", 160) as disk:
        run_dir = disk / "run"
        proc = start_run(
            run_dir,
            "actor.kind=synthetic",
            f"model.path={tiny_model_dir}",
            "train.steps=16",
            "learner.checkpoint_every=2",
            "train.group_size=4",
            "train.groups_per_batch=2",
            until="step ",
        )
        _lines_until(proc, lambda line: _latest(run_dir) == "step_000004")
        before_metrics = read_jsonl(run_dir / "metrics.jsonl")
        with sqlite3.connect(run_dir / "store.sqlite") as db:
            before_rows = db.execute("SELECT episode_id, fate FROM episodes").fetchall()
        filler = fill(disk)
        last = _lines_until(proc, lambda line: _step(line) >= 10)[-1]  # 6 and 8 at least try
        assert _latest(run_dir) < "step_000008", last  # not saved: the disk was full
        filler.unlink()
        out = "".join(_lines_until(proc, lambda line: False))
        assert proc.wait(timeout=120) == 0, out[-3000:]
        summary = orjson.loads((run_dir / "summary.json").read_bytes())
        assert summary["accounting_ok"] is True and summary["version"] == 16
        assert summary["checkpoints_failed"] >= 1 and summary["metrics_lost"] > 0
        # Nothing written before the disk filled was lost or changed.
        after = read_jsonl(run_dir / "metrics.jsonl")
        assert after[: len(before_metrics)] == before_metrics
        with sqlite3.connect(run_dir / "store.sqlite") as db:
            rows = set(db.execute("SELECT episode_id, fate FROM episodes").fetchall())
        assert set(before_rows) <= rows
        # The last checkpoint is whole and named by latest; no partial one is left.
        checkpoints = run_dir / "checkpoints"
        assert find_checkpoint(run_dir) == checkpoints / "step_000016"
        assert (checkpoints / "step_000016" / STATE_FILE).is_file()
        assert not [p for p in checkpoints.iterdir() if p.name.startswith(".tmp-")]


@pytest.mark.real
def test_a_learner_killed_mid_checkpoint_resumes_from_the_last_complete_one(tiny_model_dir, tmp_path):
    run_dir = tmp_path / "run"
    proc = start_run(
        run_dir,
        "actor.kind=synthetic",
        f"model.path={tiny_model_dir}",
        "train.steps=10",
        "learner.checkpoint_every=1",
        "train.group_size=4",
        "train.groups_per_batch=2",
        "run.restart_backoff_s=0.2",
        until="step    2/",
    )
    checkpoints = run_dir / "checkpoints"
    killed_in, kills = None, 0
    deadline = time.monotonic() + 120
    while killed_in is None and time.monotonic() < deadline:  # a save in progress, caught
        partial = [p for p in checkpoints.iterdir() if p.name.startswith(".tmp-step_")]
        learner = int((run_dir / "learner.pid").read_text())
        if partial and _step_of(partial[0]) < 8 and _alive(learner):
            complete = _latest(run_dir)
            os.killpg(learner, signal.SIGKILL)
            kills += 1
            if partial[0].exists():  # it was still being written when the learner died
                killed_in = (partial[0].name, complete)
        time.sleep(0.002)
    assert killed_in is not None, "never caught a checkpoint being written"
    out, _ = proc.communicate(timeout=400)
    assert proc.returncode == 0, out[-3000:]
    partial_name, complete = killed_in
    assert "learner died (killed by SIGKILL); restarting it" in out
    learner_log = (run_dir / "logs" / "learner.log").read_text()
    assert f"resumed from {checkpoints / complete}" in learner_log  # the last whole one
    summary = orjson.loads((run_dir / "summary.json").read_bytes())
    assert summary["accounting_ok"] is True and summary["version"] == 10
    assert summary["learner_sessions"] == kills + 1
    assert not [p for p in checkpoints.iterdir() if p.name.startswith(".tmp-")], partial_name


def _step_of(path: Path) -> int:
    return int(path.name.rsplit("_", 1)[1])


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_only_the_disk_s_failures_let_training_go_on():
    """learner/loop/saving.py carries on past a checkpoint the disk refused, never past a bug."""
    import errno

    from millstream.learner.loop.saving import disk_trouble
    from millstream.learner.persist.checkpoint import CheckpointFailed

    def failed(cause: BaseException) -> CheckpointFailed:
        try:
            raise CheckpointFailed("checkpoint step_000002 not saved") from cause
        except CheckpointFailed as exc:
            return exc

    torch_full = RuntimeError("PytorchStreamWriter failed writing file data/0: file write failed")
    assert disk_trouble(failed(OSError(errno.ENOSPC, "No space left on device")))
    assert disk_trouble(failed(OSError(errno.EDQUOT, "Disk quota exceeded")))
    assert disk_trouble(failed(torch_full))
    assert disk_trouble(
        failed(RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534"))
    )
    safetensors_full = Exception("Error while serializing: IoError(Os { code: 28, kind: StorageFull, ... })")
    assert disk_trouble(failed(safetensors_full))
    assert not disk_trouble(failed(ZeroDivisionError("a bug")))
    assert not disk_trouble(failed(OSError(errno.EACCES, "Permission denied")))
    assert not disk_trouble(failed(RuntimeError("CUDA out of memory")))
