"""The trajectory store (shared/store/trajstore.py): what goes in comes out, retention keeps what it
promises, the writer never blocks the learner, and a resume marks the abandoned rows."""

import sqlite3

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from millstream.shared.store.rundir import mark_rolled_back
from millstream.shared.store.trajstore import (
    STORE_FILE,
    episode_from_failure,
    episode_from_trajectory,
    last_id,
    open_store,
    read_episodes,
    write_episode,
)
from millstream.shared.store.writer import StoreWriter
from millstream.shared.wire import Cause, EpisodeFailed, FailedRequest, Scene, Trajectory


def trajectory(episode_id="e0", tokens=8, turns=2, reward=1.0):
    per = tokens // (2 * turns)
    mask = ([0] * per + [1] * per) * turns
    return Trajectory(
        episode_id=episode_id,
        group_id="g0",
        seed=5,
        env="echo",
        token_ids=list(range(len(mask))),
        loss_mask=mask,
        logprobs=[-0.5 if m else 0.0 for m in mask],
        versions=[3 if m else -1 for m in mask],
        reward=reward,
        turn_rewards=[reward / turns] * turns,
        num_turns=turns,
        group_size=2,
        duration_s=0.2,
        turn_starts=[(2 * t + 1) * per for t in range(turns)],
        turn_ends=[(2 * t + 2) * per for t in range(turns)],
        texts=[x for t in range(turns) for x in (f"obs{t}", f"reply{t}")] + ["bye"],
        request_ids=[f"w0-{t}" for t in range(turns)],
        success=True,
    )


def failure(episode_id="f0", partial=(7, 8, 9)):
    scene = Scene(
        env="echo",
        seed=5,
        token_ids=[1, 2, 3, 4],
        loss_mask=[0, 0, 1, 1],
        logprobs=[0.0, 0.0, -0.1, -0.2],
        versions=[-1, -1, 2, 2],
        turn_rewards=[0.5],
        turn_starts=[2],
        turn_ends=[4],
        texts=["obs0", "reply0", "obs1"],
        request_ids=["w0-1"],
        duration_s=1.5,
        request=FailedRequest(
            "w0-2", 1, list(partial), [-0.3] * len(partial), [2] * len(partial), "timed out"
        ),
    )
    return EpisodeFailed(episode_id, "g0", 2, Cause.ACTOR_TIMEOUT, "no final delta within 0.4s", scene)


def test_a_trained_and_a_failed_episode_come_back_as_they_went_in(tmp_path):
    writer = StoreWriter(tmp_path / STORE_FILE)
    traj = trajectory()
    advantages = [0.25 * m for m in traj.loss_mask]
    writer.put(
        episode_from_trajectory(traj, fate="trained", step=4, trained_version=4, advantages=advantages)
    )
    writer.put(episode_from_failure(failure(), step=4))
    writer.close()
    trained, failed = read_episodes(tmp_path / STORE_FILE)
    assert trained["fate"] == "trained" and trained["cause"] is None and trained["success"] is True
    assert trained["token_ids"] == traj.token_ids and trained["loss_mask"] == traj.loss_mask
    assert trained["versions"] == traj.versions and trained["advantages"] == advantages
    assert trained["turn_starts"] == traj.turn_starts and trained["request_ids"] == traj.request_ids
    assert [t["response"] for t in trained["turns"]] == ["reply0", "reply1"]
    assert trained["final_observation"] == "bye" and (trained["min_version"], trained["max_version"]) == (
        3,
        3,
    )
    # A failure is never scored: no reward; its scene and the failed request are kept.
    assert failed["fate"] == "failed" and failed["cause"] == "actor_timeout" and failed["reward"] is None
    assert failed["token_ids"] == [1, 2, 3, 4] and failed["turns"][0]["observation"] == "obs0"
    (request,) = failed["requests"]
    assert (
        request["request_id"] == "w0-2" and request["tokens"] == [7, 8, 9] and request["error"] == "timed out"
    )


@settings(max_examples=30, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 2**31 - 1), max_size=300),
    logprob=st.floats(-30.0, 0.0, width=32),
)
def test_token_arrays_round_trip(tmp_path_factory, tokens, logprob):
    path = tmp_path_factory.mktemp("rt") / STORE_FILE
    db = open_store(path)
    traj = trajectory()
    traj = Trajectory(
        **{
            **{f: getattr(traj, f) for f in traj.__struct_fields__},
            "token_ids": tokens,
            "loss_mask": [1] * len(tokens),
            "logprobs": [logprob] * len(tokens),
            "versions": [7] * len(tokens),
        }
    )
    with db:
        write_episode(db, episode_from_trajectory(traj, fate="trained", step=1))
    db.close()
    (back,) = read_episodes(path)
    assert back["token_ids"] == tokens and back["logprobs"] == [logprob] * len(tokens)


def test_retention_keeps_every_failure_and_the_same_share_of_successes(tmp_path):
    kept = []
    for run in ("a", "b"):
        writer = StoreWriter(tmp_path / run / STORE_FILE, keep_success=0.25)
        for i in range(400):
            writer.put(episode_from_trajectory(trajectory(f"e{i}"), fate="trained", step=1))
        for i in range(20):
            writer.put(episode_from_failure(failure(f"f{i}"), step=1))
        writer.close()
        rows = read_episodes(tmp_path / run / STORE_FILE)
        kept.append({r["episode_id"] for r in rows if r["fate"] == "trained"})
        assert sum(r["fate"] == "failed" for r in rows) == 20
        assert writer.statistics()["skipped"] == 400 - len(kept[-1])
    assert kept[0] == kept[1] and 60 <= len(kept[0]) <= 140  # the same ones, about a quarter


def test_the_size_cap_evicts_the_oldest_successes_first(tmp_path):
    path = tmp_path / STORE_FILE
    writer = StoreWriter(path, max_mb=0.5)
    for i in range(10):
        writer.put(episode_from_failure(failure(f"f{i}"), step=0))
    for i in range(1500):
        writer.put(episode_from_trajectory(trajectory(f"e{i}", tokens=200), fate="trained", step=i))
    writer.close()
    rows = read_episodes(path)
    assert writer.statistics()["evicted"] > 0
    assert sum(r["fate"] == "failed" for r in rows) == 10  # failures outlive successes
    steps = [r["step"] for r in rows if r["fate"] == "trained"]
    assert steps == sorted(steps) and steps[-1] == 1499 and steps[0] > 0  # the oldest went
    db = open_store(path, readonly=True)
    pages, size, free = (
        db.execute(f"PRAGMA {p}").fetchone()[0] for p in ("page_count", "page_size", "freelist_count")
    )
    assert (pages - free) * size <= 0.5 * 1024 * 1024


def test_a_busy_disk_never_blocks_the_learner(tmp_path):
    """Another process holds the database locked: `put` still returns at once, the queue fills,
    what does not fit is counted as dropped, and the rest is written once the lock goes."""
    path = tmp_path / STORE_FILE
    writer = StoreWriter(path, capacity=50, batch_s=0.01)
    blocker = sqlite3.connect(path, timeout=5)
    blocker.execute("BEGIN EXCLUSIVE")
    results = [
        writer.put(episode_from_trajectory(trajectory(f"e{i}"), fate="trained", step=1)) for i in range(300)
    ]
    # Every put returned while the lock is still held and nothing could be written: a put that
    # waited for the disk would hang here (this thread holds the lock), not return late.
    assert writer.statistics()["written"] == 0
    assert not all(results) and writer.statistics()["dropped"] == results.count(False)
    blocker.rollback()
    blocker.close()
    writer.close()
    assert len(read_episodes(path)) == results.count(True) == writer.statistics()["written"]


def test_a_resume_marks_the_rows_after_its_checkpoint_rolled_back(tmp_path):
    path = tmp_path / STORE_FILE
    writer = StoreWriter(path)
    for i in range(5):
        writer.put(episode_from_trajectory(trajectory(f"e{i}"), fate="trained", step=i))
    at_checkpoint = writer.last_id()
    for i in range(5, 8):
        writer.put(episode_from_trajectory(trajectory(f"e{i}"), fate="trained", step=i))
    writer.close()
    assert mark_rolled_back(tmp_path, {STORE_FILE: at_checkpoint}) == {STORE_FILE: 3}
    rows = read_episodes(path)
    assert [r["rolled_back"] for r in rows] == [False] * 5 + [True] * 3
    assert last_id(path) == 8


def test_a_reader_sees_a_live_store(tmp_path):
    path = tmp_path / STORE_FILE
    writer = StoreWriter(path, batch_s=0.01)
    writer.put(episode_from_trajectory(trajectory("e0"), fate="trained", step=1))
    writer.flush()
    reader = open_store(path, readonly=True)
    assert reader.execute("SELECT COUNT(*) FROM episodes").fetchone()[0] == 1
    writer.put(episode_from_trajectory(trajectory("e1"), fate="trained", step=2))
    writer.flush()
    assert reader.execute("SELECT COUNT(*) FROM episodes").fetchone()[0] == 2
    writer.close()
    with pytest.raises(FileNotFoundError, match="no trajectory store"):
        open_store(tmp_path / "missing.sqlite", readonly=True)
