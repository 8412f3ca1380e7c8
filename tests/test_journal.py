"""The learner's journal (learner/persist/journal.py, learner/loop/saving.py): what reached a
learner after its checkpoint is taken again by its successor, and the accounting still adds up.

Each case plays a learner at the level of its intake (the ledger, the buffer, the session; no
engine): messages, a checkpoint (the buffer's and the session's state, the journal started
after it), more messages, a death, and a successor that restores the checkpoint and replays
the journal before its workers say hello."""

from __future__ import annotations

import types
from pathlib import Path

import msgspec
import pytest

from millstream.learner.episodes.accounting import close_accounts
from millstream.learner.episodes.intake import Intake
from millstream.learner.episodes.validate import EpisodeCheck
from millstream.learner.episodes.workers import WorkerLedger
from millstream.learner.loop.saving import Saver, relabelled
from millstream.learner.loop.session import Session, restore_session, session_state
from millstream.learner.persist.journal import Journal, read_journal
from millstream.learner.persist.replaystate import buffer_state, load_buffer_state
from millstream.learner.replay import ReplayBuffer
from millstream.shared.config import LearnerConfig, load_config
from millstream.shared.wire import Cause, EpisodeFailed, GroupStarted, PoolDone, Trajectory, WorkerHello


def traj(gid: str, m: int, reward: float = 1.0, versions: list[int] | None = None) -> Trajectory:
    return Trajectory(f"{gid}-e{m}", gid, 2, "noop", [1, 2, 3], [0, 1, 1], [0.0, -0.5, -0.7],
                      versions or [-1, 0, 0], reward, [reward], 1, 2, 0.1)  # fmt: skip


class Learner:
    """One learner process, as far as its intake goes."""

    def __init__(self, run_dir: Path, workers: int = 1, version: int = 0, **learner: object) -> None:
        self.cfg = load_config(None, ["train.group_size=2", f"envpool.workers={workers}"])
        self.cfg.learner = msgspec.structs.replace(self.cfg.learner, **learner)
        self.buffer = ReplayBuffer(group_size=2, groups_per_batch=4, max_staleness=2, max_groups=64)
        self.ledger = WorkerLedger(workers, group_base=0, group_size=2)
        self.intake = Intake(
            self.cfg, self.buffer, self.ledger, EpisodeCheck(LearnerConfig(), vocab=256), lambda *r: None
        )
        self.session, self.run_dir = Session(admitted=10), run_dir  # groups 0-9 admitted
        self.trainer = types.SimpleNamespace(version=version)
        self.saver = Saver(self.cfg, run_dir, self.trainer, self.buffer, self.intake)

    def take(self, message, sender: str = "envpool-0", greeting: bool = False) -> None:
        self.intake.take(message, sender, version=self.trainer.version, admitted=self.session.admitted,
                         greeting=greeting)  # fmt: skip

    def checkpoint(self) -> dict:
        """What save_checkpoint keeps (the buffer, the session), then the journal after it."""
        nonce = f"n{self.trainer.version}"
        extra = session_state(self.session, self.run_dir, self.buffer, self.ledger, self.intake, {})
        self.saver.journal.start(self.trainer.version, nonce)
        saved = {"buffer": buffer_state(self.buffer), "extra": {**extra, "journal": nonce}}
        return msgspec.msgpack.decode(msgspec.msgpack.encode({**saved, "version": self.trainer.version}))

    @classmethod
    def resumed(cls, run_dir: Path, saved: dict, workers: int = 1, **learner: object) -> Learner:
        """A successor: the checkpoint restored (as Saver.load), then the journal replayed."""
        new = cls(run_dir, workers, version=saved["version"], **learner)
        load_buffer_state(new.buffer, saved["buffer"])
        restore_session(new.session, saved["extra"], new.ledger, new.intake)
        new.saver._nonce = saved["extra"]["journal"]
        new.saver.replay_journal(new.intake, new.session, new.ledger)
        return new

    def accounts(self, workers: int = 1) -> dict:
        return close_accounts(self.buffer, self.ledger, self.intake.done_workers, workers, resumed=True,
                              foreign=self.intake.foreign)  # fmt: skip


def test_a_worker_that_died_in_the_dead_learner_s_interval_is_accounted(tmp_path):
    """Worker process A starts groups after the checkpoint and dies; B says hello; then the
    learner dies. Only the journal knows what A started: without it, 2 started against 6
    received (a review's model of the first journal, which kept episodes only)."""
    first = Learner(tmp_path)
    first.take(WorkerHello(0, "A"))
    first.take(GroupStarted(0, "A", "g0", 2))
    saved = first.checkpoint()
    first.take(GroupStarted(0, "A", "g1", 2))
    first.take(traj("g1", 0))
    first.take(WorkerHello(0, "B"))  # A died: its unreported members are worker_lost
    first.saver.close()
    second = Learner.resumed(tmp_path, saved)
    assert second.ledger.greeted == set() and second.ledger.started_total == 4
    second.take(WorkerHello(0, "B", started=0), greeting=True)
    second.intake.release(version=0, admitted=10)
    second.take(PoolDone("w0", 0, 0, 0))
    accounts = second.accounts()
    assert accounts["accounting_ok"] is True, accounts
    assert accounts["episodes_failed"] == {"worker_lost": 3} and accounts["duplicates"] == 0


def test_refusals_and_a_backlog_larger_than_the_hold_come_back(tmp_path):
    """A refusal that closed a slot closes it again; a journal bigger than the greeting's hold
    does not end the greeting; groups the dead session admitted after the checkpoint are taken."""
    first = Learner(tmp_path)
    first.take(WorkerHello(0, "A"))
    saved = first.checkpoint()
    first.intake.max_held = 2
    first.session.admitted = 40
    first.saver.admitted(40)
    for n in range(2, 40, 2):  # groups 2..38: past the checkpoint's admission (10)
        first.intake.take(
            GroupStarted(0, "A", f"g{n}", 2), "envpool-0", version=0, admitted=40, greeting=False
        )
        first.intake.take(traj(f"g{n}", 0), "envpool-0", version=0, admitted=40, greeting=False)
        bad = traj(f"g{n}", 1, reward=float("nan"))
        first.intake.take(
            bad, "envpool-0", version=0, admitted=40, greeting=False
        )  # refused, closes its slot
    first.saver.close()
    second = Learner.resumed(tmp_path, saved)
    second.intake.max_held = 2
    assert second.intake.held == [] and second.session.admitted == 40
    stats = second.buffer.statistics()
    assert stats["refused"] == {"reward_not_finite": 19} and second.ledger.open == {}
    second.take(WorkerHello(0, "A", started=38, reported=38), greeting=True)
    second.take(PoolDone("w0", 38, 38, 0))
    assert second.accounts()["accounting_ok"] is True


def test_a_second_death_before_the_next_checkpoint_finds_it_all_again(tmp_path):
    first = Learner(tmp_path)
    first.take(WorkerHello(0, "A"))
    saved = first.checkpoint()
    first.take(GroupStarted(0, "A", "g2", 2))
    first.take(traj("g2", 0))
    first.saver.close()
    second = Learner.resumed(tmp_path, saved)
    second.take(WorkerHello(0, "A", started=2, reported=1, live=["g2-e1"]), greeting=True)
    second.take(traj("g2", 1))  # after the resume: journaled by the second learner
    second.saver.close()
    third = Learner.resumed(tmp_path, saved)
    assert third.buffer.statistics()["complete_groups"] == 1 and third.buffer.statistics()["received"] == 2


def test_a_journal_is_read_only_for_its_own_checkpoint(tmp_path):
    journal = Journal(tmp_path)
    journal.start(10, "aaaa")
    journal.message(traj("g4", 0), "envpool-0", False)
    journal.close()
    assert len(read_journal(tmp_path, 10, "aaaa").messages) == 1
    assert read_journal(tmp_path, 10, "bbbb").messages == []  # another checkpoint of version 10
    assert read_journal(tmp_path, 9, "aaaa").messages == []


def test_a_record_cut_short_by_a_kill_ends_the_journal(tmp_path):
    journal = Journal(tmp_path)
    journal.start(3, "n")
    for m in range(3):
        journal.message(traj("g1", m), None, False)
    journal.close()
    path = tmp_path / "journal" / "after_step_000003.bin"
    path.write_bytes(path.read_bytes()[:-5])
    assert [m.episode_id for m, _, _ in read_journal(tmp_path, 3, "n").messages] == ["g1-e0", "g1-e1"]


@pytest.mark.parametrize("fork, versions, expected", [
    (10, [-1, 9, 10], [-1, 9, 10]),   # the new timeline's own: as they are
    (10, [-1, 11, 13], [-1, 9, 7]),   # 1 and 3 steps past the fork: at distance 1 + (c-10)
    (2, [-1, 7], [-1, 0]),            # further than the fork is old: the oldest there is
])  # fmt: skip
def test_the_abandoned_timeline_is_relabelled_at_its_distance(fork, versions, expected):
    assert relabelled(traj("g1", 0, versions=versions), fork).versions == expected
    failure = EpisodeFailed("g1-e1", "g1", 2, Cause.ENV_ERROR, "x")
    assert relabelled(failure, fork) is failure
