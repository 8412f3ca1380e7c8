"""A learner restart loses nothing a worker still holds (envpool/redelivery.py): the worker keeps
its pushed results until a checkpoint holds them and pushes the rest again to the restarted
learner; the learner counts what it took per worker process (learner/episodes/workers.py) and
relabels tokens of the abandoned timeline (learner/episodes/intake.py).

The end-to-end case, a learner killed with SIGKILL in a real run, is in tests/test_healing.py.
Here the learner's intake, ledger and buffer meet simulated workers over simulated connections
(each a FIFO queue, as one ZeroMQ PUSH connection is), with a learner death at a random moment
that loses a random part of what was in flight.
"""

from __future__ import annotations

import random
from collections import deque
from pathlib import Path

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from millstream.envpool.redelivery import Unsettled
from millstream.learner.episodes.accounting import close_accounts
from millstream.learner.episodes.intake import Intake, held_bound
from millstream.learner.episodes.validate import EpisodeCheck
from millstream.learner.episodes.workers import WorkerLedger
from millstream.learner.loop.session import Session, restore_session, session_state
from millstream.learner.persist.replaystate import buffer_state, load_buffer_state
from millstream.learner.replay import ReplayBuffer
from millstream.shared.config import LearnerConfig, load_config
from millstream.shared.wire import (
    MAX_PREDECESSORS,
    Cause,
    Codec,
    EpisodeFailed,
    GroupStarted,
    Message,
    PolicyVersion,
    PoolDone,
    Predecessor,
    Resent,
    Settled,
    Trajectory,
    WorkerHello,
    group_id,
    member_id,
)

GROUP_SIZE = 2
WORKERS = 2


def result(gid: str, member: int, versions: list[int], failed: bool = False) -> Trajectory | EpisodeFailed:
    eid = member_id(gid, member)
    if failed:
        return EpisodeFailed(eid, gid, GROUP_SIZE, Cause.ENV_ERROR, "the environment raised")
    return Trajectory(
        eid,
        gid,
        seed=0,
        env="echo",
        token_ids=[1] * (2 + len(versions)),
        loss_mask=[0, 0] + [1] * len(versions),
        logprobs=[0.0, 0.0] + [-0.5] * len(versions),
        versions=[-1, -1] + versions,
        reward=1.0,
        turn_rewards=[1.0],
        num_turns=1,
        group_size=GROUP_SIZE,
        duration_s=0.1,
    )


# --- the worker's side -----------------------------------------------------------------------


def version(session: str, *settled: Settled) -> PolicyVersion:
    return PolicyVersion(3, 0, session=session, settled=list(settled))


def test_kept_results_are_forgotten_once_a_checkpoint_holds_them_and_the_rest_go_again():
    kept = Unsettled(0, "p1", max_bytes=1 << 20)
    assert kept.keep(result("g0", 0, [0])) is None  # the learner did not say it checkpoints yet
    kept.hear(version("s1"))
    for member in range(1, 6):
        encoded = kept.keep(result("g0", member, [0]))  # what the channel sends as it is
        assert encoded is not None and Codec().decode_one(encoded) == result("g0", member, [0])
    assert kept.statistics()["pushed"] == 6 and kept.statistics()["kept"] == 5
    kept.hear(version("s1", Settled(0, "p0", 5), Settled(1, "p1", 5)))  # not this process's
    assert kept.statistics()["kept"] == 5
    kept.hear(version("s1", Settled(0, "p1", 3)))  # the checkpoint holds results 0, 1, 2
    assert kept.statistics()["kept"] == 3
    resent = list(kept.unsaved(version("s2", Settled(0, "p1", 3))))
    assert [r.result.episode_id for r in resent] == ["g0-e3", "g0-e4", "g0-e5"]
    assert resent[0] == Resent("p1", result("g0", 3, [0]))  # decoded as it was pushed
    assert kept.statistics()["redelivered"] == 3
    kept.hear(version("s2", Settled(0, "p1", 6)))
    assert list(kept.unsaved(version("s3"))) == [] and kept.statistics()["kept_bytes"] == 0
    kept.hear(PolicyVersion(3, 0, session="s3"))  # a learner that saves no checkpoint
    kept.keep(result("g0", 6, [0]))
    assert kept.statistics()["kept"] == 0


def test_kept_results_are_bounded_by_bytes_and_the_oldest_go_first():
    one = len(msgspec.msgpack.encode(result("g0", 0, [0] * 50)))
    kept = Unsettled(0, "p1", max_bytes=3 * one + one // 2)
    kept.hear(version("s1"))
    for member in range(10):
        kept.keep(result("g0", member, [0] * 50))
    stats = kept.statistics()
    assert stats["kept"] == 3 and stats["evicted"] == 7 and stats["kept_bytes"] <= kept.max_bytes
    assert [r.result.episode_id for r in kept.unsaved(version("s2"))] == ["g0-e7", "g0-e8", "g0-e9"]


# --- the learner's side ----------------------------------------------------------------------


def test_tokens_of_the_abandoned_timeline_are_relabeled_by_their_distance():
    cfg = load_config(None, [f"train.group_size={GROUP_SIZE}"])
    buf = ReplayBuffer(GROUP_SIZE, 1, 2, 16)
    intake = Intake(cfg, buf, WorkerLedger(1, 0, GROUP_SIZE), EpisodeCheck(LearnerConfig(), 256), print)
    traj = result("g0", 0, [4, 6, 7])
    assert intake.onto_this_timeline(traj) is traj  # not resumed: nothing to relabel
    intake.resumed_at = 5  # the dead learner reached 7; this session went back to 5
    assert intake.onto_this_timeline(traj).versions == [-1, -1, 4, 4, 3]
    assert intake.onto_this_timeline(result("g0", 1, [5])).versions == [-1, -1, 5]
    # Further from this policy (at 5) than 5 steps: below -1, which only a relabeled one may be.
    far = intake.onto_this_timeline(result("g0", 1, [12]))
    assert far.versions == [-1, -1, -2]
    check = EpisodeCheck(LearnerConfig(), 256)
    assert check.problem(far, version=5, admitted=1, relabeled=True) is None
    assert check.problem(far, version=5, admitted=1).reason == "version"


def test_the_intake_relabels_what_can_only_be_of_the_abandoned_timeline():
    """Resent and held trajectories, and any with a version past the learner's own; not one
    taken after the greeting whose versions this session may have made itself."""
    cfg = load_config(None, [f"train.group_size={GROUP_SIZE}"])
    buf = ReplayBuffer(GROUP_SIZE, 1, 100, 16)
    intake = Intake(cfg, buf, WorkerLedger(1, 0, GROUP_SIZE), EpisodeCheck(LearnerConfig(), 256), print)
    intake.resumed_at = 5
    take = dict(sender=None, version=7, admitted=10, greeting=False)
    intake.take(Resent("p", result("g0", 0, [6, 9])), **take)  # resent: 9 > 7 and 6 both moved
    intake.take(Resent("p", result("g0", 0, [6, 9])), **take)  # its second copy: not counted again
    intake.take(result("g1", 0, [6, 8]), **take)  # 8 is past this session's 7: the dead one's
    intake.take(result("g2", 0, [6, 7]), **take)  # may be this session's own 6 and 7: kept
    versions = {
        t.group_id: t.versions[2:] for t in buf._pending["g0"].trajectories + buf._pending["g1"].trajectories
    }
    assert versions == {"g0": [4, 1], "g1": [4, 2]}
    assert buf._pending["g2"].trajectories[0].versions[2:] == [6, 7]
    assert intake.relabeled == 2 and buf.resent_duplicates == 1 and buf.duplicates == 0


def test_a_group_of_the_session_before_is_relabeled_whatever_its_versions():
    """After a resume at C, an episode running through the restart may hold tokens of the dead
    learner's C+1.. made before this session's own C+1.. existed; once this session reaches
    those numbers, nothing in the versions tells them apart, and they were trained as this
    session's (past the staleness bound). A group numbered below the session's floor (admitted
    by the session before) is relabeled whatever its versions; this session's groups are not."""
    cfg = load_config(None, [f"train.group_size={GROUP_SIZE}"])
    buf = ReplayBuffer(GROUP_SIZE, 1, 100, 16)
    intake = Intake(cfg, buf, WorkerLedger(1, 0, GROUP_SIZE), EpisodeCheck(LearnerConfig(), 256), print)
    intake.resumed_at, buf.floor = 5, 4  # g0..g3 were admitted before the restart
    take = dict(sender=None, version=6, admitted=10, greeting=False)
    intake.take(result("g0", 0, [6, 6]), **take)  # may be the dead learner's 6: 2C - 6 = 4
    intake.take(result("g4", 0, [6, 6]), **take)  # admitted by this session, after its push of 5
    assert buf._pending["g0"].trajectories[0].versions[2:] == [4, 4]
    assert buf._pending["g4"].trajectories[0].versions[2:] == [6, 6]
    assert intake.relabeled == 1


class Learner:
    """The learner's intake, ledger and buffer, as rank 0 holds them; `restart` is a new session
    from a checkpoint's state (what learner/loop/leader.py does on `run.resume`)."""

    def __init__(self, checkpoint: dict | None = None) -> None:
        self.cfg = load_config(None, [f"train.group_size={GROUP_SIZE}", f"envpool.workers={WORKERS}"])
        self.buffer = ReplayBuffer(GROUP_SIZE, 1, max_staleness=100, max_groups=10_000)
        self.ledger = WorkerLedger(WORKERS, 0, GROUP_SIZE)
        check = EpisodeCheck(LearnerConfig(), 256)
        self.intake = Intake(self.cfg, self.buffer, self.ledger, check, lambda failure, version: None)
        self.session = Session()
        self.version = 0
        self.greeting = checkpoint is not None
        #: Results the intake took (handled, not held): what a checkpoint now would hold.
        self.taken: set[str] = set()
        self._held: list[str] = []
        if checkpoint is not None:
            raw = msgspec.msgpack.decode(msgspec.msgpack.encode(checkpoint))  # as from disk
            load_buffer_state(self.buffer, raw["buffer"])
            restore_session(self.session, raw["extra"], self.ledger, self.intake)
            self.version = self.intake.resumed_at = raw["version"]
            self.taken = set(raw["taken"])  # the simulation's record of what that checkpoint held

    def take(self, message: Message, sender: str) -> None:
        held = len(self.intake.held)
        self.intake.take(message, sender, version=self.version, admitted=10**9, greeting=self.greeting)
        if isinstance(message, (Trajectory, EpisodeFailed, Resent)):
            eid = message.result.episode_id if isinstance(message, Resent) else message.episode_id
            if len(self.intake.held) > held:
                self._held.append(eid)
            else:
                self.taken.add(eid)

    def end_greeting(self) -> None:
        self.greeting = False
        self.intake.release(version=self.version, admitted=10**9)
        self.taken.update(self._held)
        self._held = []

    def check_counts(self, workers: list[SimWorker]) -> None:
        """The invariant: the first n results of each process its count n claims were taken."""
        for w in workers:
            n = self.ledger.reports.get((w.index, w.incarnation), 0)
            assert set(w.pushed_ids[:n]) <= self.taken, (w.incarnation, n, len(w.pushed_ids))

    def checkpoint(self) -> dict:
        extra = session_state(self.session, Path("run"), self.buffer, self.ledger, self.intake, {})
        self.ledger.mark_saved(extra["ledger"])  # saved: announced from now on
        state = {"buffer": buffer_state(self.buffer), "extra": extra, "version": self.version}
        return state | {"taken": sorted(self.taken)}

    def announcement(self) -> PolicyVersion:
        return PolicyVersion(self.version, 0, session=self.session.id, settled=self.ledger.settled())


class SimWorker:
    """An envpool worker reduced to what the learner sees of it: it starts groups, pushes one
    result per member over its connection (`wire`), keeps them (envpool/redelivery.py) and greets
    each learner session, pushing again first what that session's checkpoint lacks."""

    def __init__(self, index: int, incarnation: int = 0, next_number: int | None = None) -> None:
        self.index, self.incarnation = index, f"w{index}-process{incarnation}"
        self.sender = f"envpool-{index}"
        self.kept = Unsettled(index, self.incarnation, max_bytes=1 << 30)
        self.wire: deque[Message] = deque()
        #: Its results' episode ids, in the order pushed (their numbers).
        self.pushed_ids: list[str] = []
        self.started = 0
        self.live: list[str] = []
        self.next_number = index if next_number is None else next_number
        #: The numbers of the first and the last group this process started (-1: none yet).
        self.first_number = self.last_number = -1
        self.session: str | None = None
        #: The processes of this index that died before this one, oldest first.
        self.predecessors: list[SimWorker] = []
        #: Dead, with part of its connection's queue still arriving (`plan["late"]`).
        self.dead = False
        self.late_delivered = 0

    def successor(self) -> SimWorker:
        """The process the launcher starts after this one died with what it kept and queued.
        It numbers past the last group any predecessor started (its lineage file says which)."""
        after = SimWorker(self.index, int(self.incarnation[-1]) + 1, self.next_number)
        after.predecessors = [*self.predecessors, self]
        return after

    def die(self, late: float, ghosts: list[SimWorker]) -> SimWorker:
        """Killed: the first `late` share of its connection's queue was in the kernel's buffers
        and still arrives (from `ghosts`), the rest dies with it. Returns its successor."""
        self.dead = True
        self.wire = deque(list(self.wire)[: int(len(self.wire) * late)])
        ghosts.append(self)
        return self.successor()

    def start_group(self) -> str:
        gid = group_id(self.next_number)
        self.first_number = self.next_number if self.first_number < 0 else self.first_number
        self.last_number = self.next_number
        self.next_number += WORKERS
        self.wire.append(GroupStarted(self.index, self.incarnation, gid, GROUP_SIZE))
        self.started += GROUP_SIZE
        self.live += [member_id(gid, m) for m in range(GROUP_SIZE)]
        return gid

    def finish_one(self, rng: random.Random, version: int) -> None:
        eid = self.live.pop(rng.randrange(len(self.live)))
        gid, member = eid.rsplit("-e", 1)
        message = result(gid, int(member), [version], failed=rng.random() < 0.2)
        self.kept.keep(message)
        self.wire.append(message)
        self.pushed_ids.append(eid)

    def hear(self, announcement: PolicyVersion) -> None:
        """What envpool/worker.py does with each `PolicyVersion`."""
        if announcement.session != self.session:
            self.wire.extend(self.kept.unsaved(announcement))
            lineage = [  # its file
                Predecessor(p.incarnation, p.started, p.first_number, p.last_number)
                for p in self.predecessors
            ]
            hello = WorkerHello(
                self.index,
                self.incarnation,
                self.started,
                self.kept.pushed,
                live=sorted(self.live),
                # Where its numbering stands; before its first group a worker from before
                # 2026-11-28 said 0 (the learner must not keep what it cannot place for it).
                next_group=self.next_number if self.started else 0,
                lineage=lineage[-MAX_PREDECESSORS:],
            )
            self.wire.append(hello)
            self.session = announcement.session
        self.kept.hear(announcement)


def deliver(learner: Learner, workers: list[SimWorker], rng: random.Random, count: int) -> None:
    """Up to `count` messages, from the workers' connections in a random interleaving."""
    for _ in range(count):
        busy = [w for w in workers if w.wire]
        if not busy:
            return
        worker = rng.choice(busy)
        learner.take(worker.wire.popleft(), worker.sender)
        worker.late_delivered += worker.dead


def play(learner: Learner, workers: list[SimWorker], rng: random.Random, ticks: int, plan: dict) -> dict:
    """`ticks` of a session: workers start groups and finish episodes, the learner takes some of
    what is on the wires, trains now and then, and checkpoints (checking its counts each time);
    a worker hears each announcement with probability `plan["heard"]`, and worker 0 dies at tick
    `plan["worker_death"]`: the first `plan["late"]` of its connection's queue was in the
    kernel's buffers and still arrives, interleaved with the rest (`plan["ghosts"]`). Returns
    the latest checkpoint."""
    checkpoint = learner.checkpoint()
    for tick in range(ticks):
        if tick == plan["worker_death"]:
            workers[0] = workers[0].die(plan["late"], plan["ghosts"])
            workers[0].hear(learner.announcement())
        for w in workers:
            if rng.random() < 0.3 or not w.live:
                w.start_group()
            if w.live and rng.random() < 0.7:
                w.finish_one(rng, learner.version)
        deliver(learner, workers + plan["ghosts"], rng, rng.randrange(0, 4))
        if rng.random() < 0.15:
            learner.version += 1
        if rng.random() < 0.1:
            learner.check_counts(workers)
            checkpoint = learner.checkpoint()
        for w in workers:
            if rng.random() < plan["heard"]:
                w.hear(learner.announcement())
    return checkpoint


def restart(
    checkpoint: dict,
    workers: list[SimWorker],
    rng: random.Random,
    lost: float,
    max_held: int | None,
    plan: dict,
) -> Learner:
    """The learner died: part of each connection's queue with it (`lost`); a new session from
    the checkpoint greets every worker (each pushes again what it lacks, then says hello). With
    `plan["greeting_death"]`, worker 0 dies once it queued its greeting, before the learner
    took all of it, and its successor greets in its place."""
    for w in workers:
        for _ in range(int(len(w.wire) * lost)):
            w.wire.popleft()
        for dead in w.predecessors:  # what a dead process had in flight died with the learner
            dead.wire.clear()
    learner = Learner(checkpoint)
    learner.intake.max_held = max_held if max_held is not None else learner.intake.max_held
    for w in workers:
        w.hear(learner.announcement())
    if plan["greeting_death"]:
        deliver(learner, workers, rng, rng.randrange(0, 4))
        workers[0] = workers[0].die(plan["late"], plan["ghosts"])
        workers[0].hear(learner.announcement())
    while any(w.wire for w in workers + plan["ghosts"]):
        deliver(learner, workers + plan["ghosts"], rng, 1)
    learner.end_greeting()
    return learner


@settings(max_examples=150, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    lost=st.floats(0, 1),
    heard=st.floats(0, 1),
    worker_death=st.none() | st.integers(0, 240),
    late=st.sampled_from([0.0, 0.5, 1.0]),
    max_held=st.sampled_from([None, 3]),
    greeting_death=st.booleans(),
)
def test_learner_restarts_lose_nothing_the_workers_kept(
    seed, lost, heard, worker_death, late, max_held, greeting_death
):
    """Workers run groups while the learner takes their results and checkpoints; it dies twice
    at random moments, and of what was in flight a random share (`lost`) dies with its sockets;
    the rest arrives as the backlog. A worker hears each announcement only with probability
    `heard`. Each restarted session gets everything anyway, each result once (second copies are
    counted as resent duplicates), every checkpoint's count of a worker's results covers only
    results it took, and the run's accounts close with no `learner_lost`. With `worker_death`,
    worker 0 dies at that tick, with what it kept and queued: its episodes are `worker_lost`,
    those whose announcements died with it (or with a learner that died before its next
    checkpoint) counted from its successor's lineage, and the accounts still count every
    episode every process started, whatever share of its queue (`late`) still arrives after
    its successor's hello. With `greeting_death`, worker 0 also dies during each restarted
    learner's greeting, after it queued its hello. With `max_held`, a restarted learner holds
    only that many messages through its greeting and takes the rest as they come."""
    rng = random.Random(seed)
    workers = [SimWorker(i) for i in range(WORKERS)]
    learner = Learner()
    for w in workers:
        w.hear(learner.announcement())
    first, second = rng.randrange(40, 120), rng.randrange(20, 120)
    ghosts: list[SimWorker] = []
    death = {
        "heard": heard,
        "worker_death": worker_death,
        "late": late,
        "ghosts": ghosts,
        "greeting_death": greeting_death,
    }
    checkpoint = play(learner, workers, rng, first, death)
    learner = restart(checkpoint, workers, rng, lost, max_held, death)
    later = death | {"worker_death": None if worker_death is None else worker_death - first}
    checkpoint = play(learner, workers, rng, second, later)
    learner = restart(checkpoint, workers, rng, lost, max_held, death)
    for w in workers:  # the rest of the run: every live episode reports, then PoolDone
        while w.live:
            w.finish_one(rng, learner.version)
        w.wire.append(PoolDone(f"w{w.index}", w.started, 0, 0))
    while any(w.wire for w in workers):
        deliver(learner, workers, rng, 1)
    learner.buffer.drain()  # what close_run does first
    accounts = close_accounts(
        learner.buffer, learner.ledger, learner.intake.done_workers, WORKERS, True, learner.intake.foreign
    )
    assert accounts["accounting_ok"], accounts
    everyone = workers + [dead for w in workers for dead in w.predecessors]
    assert accounts["episodes_started"] == sum(w.started for w in everyone), accounts
    assert "learner_lost" not in accounts["episodes_failed"], accounts
    # A dead process's late results are not taken again: its groups were closed at its
    # successor's hello (refused, or a second copy of the failure).
    late_results = sum(g.late_delivered for g in ghosts)
    refused = sum(accounts["episodes_refused"].values()) + accounts["duplicates"]
    assert refused <= late_results and set(accounts["episodes_refused"]) <= {"unstarted_group"}, accounts
    # The counts reached what each worker pushed: after a last checkpoint, every worker forgets
    # all it kept.
    learner.check_counts(workers)
    learner.checkpoint()
    for w in workers:
        w.hear(learner.announcement())
        assert w.kept.statistics()["kept"] == 0, w.kept.statistics()
    assert accounts["open_groups"] == 0
    assert learner.ledger.unclaimed == {}  # every result of an unknown group was placed


def test_a_greeting_holds_what_a_dead_learner_may_have_had_since_its_checkpoint():
    """The soak's settings: 256 running, and 2 x (5 steps between checkpoints + 2 of admission
    window) x 32 episodes a step: the backlog and its resent copies, held apart from the rest."""
    overrides = ["train.group_size=8", "train.groups_per_batch=4", "train.max_staleness=1"]
    cfg = load_config(None, [*overrides, "learner.checkpoint_every=5", "envpool.max_concurrent_episodes=256"])
    assert held_bound(cfg) == 256 + 2 * 7 * 32
