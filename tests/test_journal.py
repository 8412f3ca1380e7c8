"""The learner's journal (learner/persist/journal.py): what reached it after its checkpoint,
read back by a restarted learner; a torn tail (a kill mid-write) ends it cleanly."""

from __future__ import annotations

import msgspec

from millstream.learner.persist.journal import Journal, replay
from millstream.shared.wire import Cause, EpisodeFailed, Trajectory


def traj(gid: str, m: int) -> Trajectory:
    return Trajectory(f"{gid}-e{m}", gid, 7, "noop", [1, 2, 3], [0, 1, 1], [0.0, -0.5, -0.7], [-1, 3, 4],
                      1.0, [1.0], 1, 2, 0.1)  # fmt: skip


def test_episodes_and_versions_come_back_after_their_checkpoint(tmp_path):
    journal = Journal(tmp_path, 10)
    journal.episode(traj("g4", 0), "envpool-0")
    journal.step(11)
    journal.episode(EpisodeFailed("g5-e1", "g5", 2, Cause.ENV_ERROR, "x"), "envpool-1")
    journal.step(12)
    journal.close()
    found = replay(tmp_path, 10)
    assert [(m.episode_id, s) for m, s in found.episodes] == [("g4-e0", "envpool-0"), ("g5-e1", "envpool-1")]
    assert found.episodes[0][0] == traj("g4", 0) and found.last_version == 12
    assert replay(tmp_path, 9).episodes == [] and replay(tmp_path, 9).last_version is None


def test_a_new_checkpoint_starts_a_new_file_and_drops_the_old(tmp_path):
    journal = Journal(tmp_path, 10)
    journal.episode(traj("g4", 0), "envpool-0")
    journal.start(20)  # the checkpoint of version 20 holds g4-e0 now
    journal.episode(traj("g6", 1), "envpool-0")
    journal.close()
    assert [p.name for p in (tmp_path / "journal").iterdir()] == ["after_step_000020.bin"]
    assert [m.episode_id for m, _ in replay(tmp_path, 20).episodes] == ["g6-e1"]


def test_a_record_cut_short_by_a_kill_ends_the_journal(tmp_path):
    journal = Journal(tmp_path, 3)
    for m in range(3):
        journal.episode(traj("g1", m), None)
    journal.close()
    path = tmp_path / "journal" / "after_step_000003.bin"
    data = path.read_bytes()
    path.write_bytes(data[:-5])  # the last record's tail never reached the file
    assert [m.episode_id for m, _ in replay(tmp_path, 3).episodes] == ["g1-e0", "g1-e1"]
    path.write_bytes(data + msgspec.msgpack.encode(["junk"])[:2])  # a header without its body
    assert len(replay(tmp_path, 3).episodes) == 3
