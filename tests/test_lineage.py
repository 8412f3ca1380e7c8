"""What a dead worker process announced reaches the learner through its successor
(envpool/lineage.py): the count and the group numbers survive a SIGKILL in a real file, the
successor numbers past them, and the learner counts what it never heard announced as
`worker_lost`, once, late announcements and late results included
(learner/episodes/workers.py).

The whole protocol, with worker and learner deaths at random moments, is
tests/test_redelivery.py's simulation, which checks that the run's accounts count every
episode every process started.
"""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from millstream.envpool.gate import AdmissionGate
from millstream.envpool.lineage import Lineage, read_lineage
from millstream.learner.episodes.accounting import close_accounts
from millstream.learner.episodes.intake import Intake
from millstream.learner.episodes.lineages import EVERYTHING
from millstream.learner.episodes.validate import EpisodeCheck
from millstream.learner.episodes.workers import WorkerLedger
from millstream.learner.replay import ReplayBuffer
from millstream.shared.config import LearnerConfig, load_config
from millstream.shared.wire import (
    MAX_COUNT,
    MAX_PREDECESSORS,
    Cause,
    Codec,
    EpisodeFailed,
    GroupStarted,
    PolicyVersion,
    PoolDone,
    Predecessor,
    ProtocolError,
    Resent,
    Trajectory,
    WorkerHello,
    group_id,
    member_id,
)

SIZE = 4


def test_a_killed_process_leaves_its_count_for_its_successor(tmp_path):
    """A process announcing as fast as it can is killed with SIGKILL: the file holds the count
    and the group numbers it had reached (what it printed last, or one group more), and the
    next process reads them and numbers past them."""
    path = tmp_path / "envpool-w0.lineage"
    first = Lineage.open(path, "aaaa")
    first.announce(SIZE, 3)
    first.close()
    code = (
        "import sys\n"
        "from pathlib import Path\n"
        "from millstream.envpool.lineage import Lineage\n"
        f"lineage = Lineage.open(Path({str(path)!r}), 'bbbb')\n"
        "number = 5\n"
        "while True:\n"
        f"    lineage.announce({SIZE}, number)\n"
        "    print(lineage.announced, flush=True)\n"
        "    number += 2\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    printed = [int(proc.stdout.readline()) for _ in range(2000)]
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    after = read_lineage(path)
    assert [p.incarnation for p in after] == ["aaaa", "bbbb"]
    assert after[0] == Predecessor("aaaa", SIZE, 3, 3)
    assert printed[-1] <= after[1].announced  # it may have written one more before the kill
    groups = after[1].announced // SIZE
    assert (after[1].first_group, after[1].last_group) == (5, 5 + 2 * (groups - 1))
    successor = Lineage.open(path, "cccc")
    assert successor.predecessors == after
    assert successor.numbered_past == after[1].last_group + 1
    assert [p.incarnation for p in read_lineage(path)] == ["aaaa", "bbbb", "cccc"]


def test_a_file_names_only_the_latest_predecessors(tmp_path):
    path = tmp_path / "envpool-w0.lineage"
    for n in range(MAX_PREDECESSORS + 3):
        Lineage.open(path, f"p{n}").announce(n, n)
    named = Lineage.open(path, "last").predecessors
    assert [p.incarnation for p in named] == [f"p{n}" for n in range(3, MAX_PREDECESSORS + 3)]
    assert [p.announced for p in named] == list(range(3, MAX_PREDECESSORS + 3))
    assert Lineage.open(None, "by-hand").predecessors == []  # no run directory: no file


def test_a_file_of_the_older_layout_reads_without_numbers_and_a_bad_line_is_skipped(tmp_path):
    path = tmp_path / "envpool-w0.lineage"
    path.write_bytes(
        b"old 00000000000000000008\n"  # before the numbers: read, with none
        b"bad 00000000000000000004 -0000000000000000001 -0000000000000000001\n"  # count, no group
        b"new 00000000000000000004 00000000000000000006 00000000000000000006\n"
    )
    assert read_lineage(path) == [Predecessor("old", 8), Predecessor("new", SIZE, 6, 6)]
    assert Lineage.open(path, "next").numbered_past == 7


def test_a_successor_numbers_past_its_predecessors_groups_the_learner_never_heard_of():
    """The learner says where worker 1 of 2 continues (next_groups: past what it heard); the
    lineage says its dead process announced up to group 9, whose announcement died with it."""
    gate = AdmissionGate(worker_index=1, workers=2, numbered_past=10)
    gate.update(PolicyVersion(0, 100, session="s", next_groups=[4, 5]))
    assert gate.next_group == 11
    fresh = AdmissionGate(worker_index=1, workers=2)
    fresh.update(PolicyVersion(0, 100, session="s", next_groups=[4, 5]))
    assert fresh.next_group == 5


class Learner:
    """The learner's intake, ledger and buffer, as rank 0 holds them."""

    def __init__(self, sender: str | None = "envpool-0") -> None:
        self.sender = sender  # worker 0's key, or None: a run without CURVE
        cfg = load_config(None, [f"train.group_size={SIZE}", "envpool.workers=1"])
        self.buffer = ReplayBuffer(SIZE, 1, max_staleness=100, max_groups=1000)
        self.ledger = WorkerLedger(1, 0, SIZE)
        check = EpisodeCheck(LearnerConfig(), 256)
        self.intake = Intake(cfg, self.buffer, self.ledger, check, lambda failure, version: None)

    def take(self, *messages) -> None:
        for message in messages:
            self.intake.take(message, self.sender, version=0, admitted=10**6, greeting=False)

    def accounts(self) -> dict:
        self.buffer.drain()
        return close_accounts(
            self.buffer, self.ledger, self.intake.done_workers, 1, False, self.intake.foreign
        )


def announce(incarnation: str, number: int) -> GroupStarted:
    return GroupStarted(0, incarnation, group_id(number), SIZE)


def failure(number: int, member: int, cause: Cause) -> EpisodeFailed:
    return EpisodeFailed(member_id(group_id(number), member), group_id(number), SIZE, cause, "")


@pytest.mark.parametrize("sender", ["envpool-0", None])
def test_what_a_dead_process_announced_unheard_is_lost_once_and_late_news_is_not_counted_twice(sender):
    learner = Learner(sender)
    learner.take(WorkerHello(0, "a"), announce("a", 0))
    # Process a announced groups 1 and 2 too, and died with them in its queues; its file said 12.
    learner.take(WorkerHello(0, "b", lineage=[Predecessor("a", 3 * SIZE)]))
    lost = {str(Cause.WORKER_LOST): 3 * SIZE}
    assert learner.buffer.statistics()["failed"] == lost  # group 0's members by id, the rest counted
    assert learner.ledger.statistics()["worker_lost_unheard"] == 2 * SIZE
    # Group 1's announcement arrives after all (late, from the dead): one of those counted, now
    # by id; its results, late too, are not taken again (its group is closed).
    learner.take(announce("a", 1), failure(1, 0, Cause.ENV_ERROR))
    assert learner.buffer.statistics()["failed"] == lost
    assert sum(learner.intake.refusals.counts.values()) + learner.buffer.duplicates == 1
    assert learner.ledger.late_groups == 1 and learner.ledger.lost_unheard == SIZE
    # Group 2's too; then one past what the file said: started and lost together, with ids.
    learner.take(announce("a", 2), announce("a", 3))
    assert learner.buffer.statistics()["failed"] == {str(Cause.WORKER_LOST): 4 * SIZE}
    assert learner.ledger.lost_unheard == 0
    # The dead process's own hello, reordered behind its successor's: refused, b stays live.
    learner.take(WorkerHello(0, "a", started=4 * SIZE))
    assert learner.ledger.incarnations[0] == "b" and learner.intake.refusals.counts["retired_hello"] == 1
    # The successor's own group, and a second hello naming the same predecessor (a restarted
    # learner's session): nothing counted again.
    learner.take(announce("b", 4), *(failure(4, m, Cause.ENV_ERROR) for m in range(SIZE)))
    learner.take(WorkerHello(0, "b", started=SIZE, lineage=[Predecessor("a", 3 * SIZE)]))
    learner.take(PoolDone("w0", SIZE, 0, SIZE))
    accounts = learner.accounts()
    assert accounts["accounting_ok"], accounts
    assert accounts["episodes_started"] == 5 * SIZE  # a's 4 groups, b's 1
    assert accounts["episodes_failed"] == {str(Cause.WORKER_LOST): 4 * SIZE, str(Cause.ENV_ERROR): SIZE}
    assert accounts["open_groups"] == 0


def test_a_count_no_sum_of_can_overflow_does_not_decode():
    """Metrics and checkpoints hold 64-bit integers: a hello may not state more than 2**40."""
    codec = Codec()
    frame = codec.encode([WorkerHello(0, "b", lineage=[Predecessor("a", MAX_COUNT + 1)])])
    with pytest.raises(ProtocolError, match="<= 1099511627776"):
        codec.decode(frame)
    assert codec.decode(codec.encode([WorkerHello(0, "b", lineage=[Predecessor("a", MAX_COUNT)])]))


def test_a_lineage_that_says_less_than_the_learner_heard_changes_nothing():
    """A file behind the learner (a successor on another machine starts a new one) is no news."""
    learner = Learner()
    learner.take(WorkerHello(0, "a"), announce("a", 0), announce("a", 1))
    learner.take(WorkerHello(0, "b", lineage=[Predecessor("a", SIZE)]))
    assert learner.buffer.statistics()["failed"] == {str(Cause.WORKER_LOST): 2 * SIZE}
    assert learner.ledger.started_total == 2 * SIZE and learner.ledger.lost_unheard == 0


def test_what_is_left_unheard_survives_a_checkpoint_in_either_layout():
    """A retired process's id-less count goes through `state_dict`; a checkpoint written before
    the count lived beside its process (a list of processes, and "unheard" apart) loads too."""
    learner = Learner()
    learner.take(WorkerHello(0, "a"), announce("a", 0))
    learner.take(WorkerHello(0, "b", lineage=[Predecessor("a", 3 * SIZE, 0, 2)]))
    state = learner.ledger.state_dict()
    no_numbers = {key: value for key, value in state.items() if key not in ("counted", "unclaimed")}
    no_numbers["retired"] = {"0": [["a", 2 * SIZE]]}
    older = dict(no_numbers, retired={"0": ["a"]}, unheard=[[0, "a", 2 * SIZE]])
    for saved in (state, no_numbers, older):
        restored = WorkerLedger(1, 0, SIZE)
        restored.load_state_dict(saved)
        assert restored.is_retired(0, "a") and not restored.is_retired(0, "b")
        if "counted" not in saved:  # the live process heard all below its numbering; a, unknown
            assert restored.counted[(0, "b")].below == restored.next_groups[0]
            assert restored.counted[(0, "a")].below == EVERYTHING
        # A late announcement of a counted group moves its count to its members, once each.
        _, counted = restored.group_started(announce("a", 1))
        assert counted == SIZE
        _, counted = restored.group_started(announce("a", 2))
        assert counted == SIZE
        _, counted = restored.group_started(announce("a", 3))
        assert counted == 0  # past what the lineage said


def trajectory(number: int, member: int) -> Trajectory:
    gid = group_id(number)
    return Trajectory(
        member_id(gid, member),
        gid,
        seed=0,
        env="echo",
        token_ids=[1, 1],
        loss_mask=[0, 1],
        logprobs=[0.0, -0.5],
        versions=[-1, 0],
        reward=1.0,
        turn_rewards=[1.0],
        num_turns=1,
        group_size=SIZE,
        duration_s=0.1,
    )


@pytest.mark.parametrize("before_the_lineage", [False, True])
def test_a_result_of_a_group_never_heard_of_is_received_not_lost(before_the_lineage):
    """Process a announced groups 0-2; the learner heard of group 0 only. Group 1's results
    arrive anyway (pushed again to a restarted learner), before its successor's hello named it
    or after: they leave the id-less count, group 1 is not lost, and group 0's (heard) and
    group 3's (not a's: past its last group) count nothing back."""
    learner = Learner()
    learner.take(WorkerHello(0, "a", next_group=0), announce("a", 0))
    late = [Resent("a", trajectory(1, m)) for m in range(SIZE)]
    hello = WorkerHello(0, "b", next_group=3, lineage=[Predecessor("a", 3 * SIZE, 0, 2)])
    learner.take(*(late + [hello] if before_the_lineage else [hello] + late))
    ledger = learner.ledger
    assert ledger.lost_unheard == SIZE and ledger.unclaimed == {}  # group 2's, without ids
    assert learner.buffer.statistics()["failed"] == {str(Cause.WORKER_LOST): 2 * SIZE}  # 0 and 2
    assert not ledger.received_unknown(0, group_id(0)) and not ledger.received_unknown(0, group_id(3))
    assert ledger.lost_unheard == SIZE


def test_a_lineage_closes_the_groups_of_every_process_it_names_not_only_the_live_one():
    """A restored checkpoint knew process a as live; b (a's successor, which greeted the dead
    learner after that checkpoint) announced a group; c's hello names both dead: the groups of
    both are closed, their members `worker_lost` by id."""
    learner = Learner()
    learner.take(WorkerHello(0, "a"), announce("a", 0), announce("b", 1))
    assert learner.ledger.incarnations[0] == "a"
    lineage = [Predecessor("a", SIZE, 0, 0), Predecessor("b", SIZE, 1, 1)]
    learner.take(WorkerHello(0, "c", next_group=2, lineage=lineage))
    assert learner.ledger.open == {}
    assert learner.buffer.statistics()["failed"] == {str(Cause.WORKER_LOST): 2 * SIZE}
    assert learner.ledger.lost_unheard == 0 and learner.ledger.unclaimed == {}
