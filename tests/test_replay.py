"""Tests of learner.replay: grouping, staleness, duplicates, FIFO, bounds and exact accounting."""

from __future__ import annotations

import itertools

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from millstream.learner.persist.replaystate import buffer_state, load_buffer_state
from millstream.learner.replay import BufferFull, Group, ReplayBuffer
from millstream.shared.wire import Cause, DropCause, EpisodeFailed, Trajectory

_ids = itertools.count()


def traj(
    group: str,
    version: int = 0,
    *,
    reward: float = 1.0,
    episode: str | None = None,
    group_size: int = 4,
    versions: list[int] | None = None,
) -> Trajectory:
    """A small valid trajectory: 2 prompt tokens, then generated tokens at `versions`."""
    gen = versions if versions is not None else [version, version]
    return Trajectory(
        episode_id=episode or f"ep{next(_ids)}",
        group_id=group,
        seed=0,
        env="test",
        token_ids=list(range(2 + len(gen))),
        loss_mask=[0, 0] + [1] * len(gen),
        logprobs=[0.0, 0.0] + [-0.5] * len(gen),
        versions=[-1, -1] + gen,
        reward=reward,
        turn_rewards=[reward],
        num_turns=1,
        group_size=group_size,
        duration_s=0.1,
    )


def failure(
    group: str, *, cause: Cause = Cause.ENV_ERROR, episode: str | None = None, group_size: int = 4
) -> EpisodeFailed:
    return EpisodeFailed(episode or f"ep{next(_ids)}", group, group_size, cause, "boom")


def buffer(**kw) -> ReplayBuffer:
    return ReplayBuffer(
        **{"group_size": 4, "groups_per_batch": 1, "max_staleness": 1, "max_groups": 100} | kw
    )


def groups(s: dict) -> tuple[int, int, int]:
    return s["complete_groups"], s["partial_groups"], s["dropped_groups"]


def check_invariant(buf: ReplayBuffer) -> dict:
    s = buf.statistics()
    gone = s["trained"] + sum(s["dropped"].values()) + sum(s["failed"].values())
    assert s["received"] == gone + s["buffered"], s
    return s


def test_a_per_group_filter_fills_the_batch_with_groups_that_pass():
    """zero_std (DAPO's dynamic sampling): a group without a reward spread is dropped as it
    completes, counted under its cause, and the batch waits for `groups_per_batch` groups with
    one. It used to take a batch's worth of groups and step on whatever of them passed. Each
    group is tested once: the drops in a row count on while one that passed waits (a count
    that restarted at every look would never warn of a run whose signal was gone)."""
    from millstream.learner.train.advantages import has_reward_spread

    buf = buffer(group_size=2, groups_per_batch=2, keep=has_reward_spread)

    def complete(gid: str, rewards: list[float]) -> None:
        for r in rewards:
            buf.add(traj(gid, reward=r, group_size=2))

    complete("g0", [1.0, 1.0])
    complete("g1", [0.0, 1.0])
    assert buf.take_batch(0) is None  # g0 dropped; g1 waits for a second
    s = check_invariant(buf)
    assert s["dropped"] == {"filtered_zero_std": 2} and groups(s) == (1, 0, 1)
    for n in range(2, 12):  # ten without a spread, looked at after each
        complete(f"g{n}", [0.5, 0.5])
        assert buf.take_batch(0) is None
    assert buf.rejected_in_a_row == 10
    complete("g12", [1.0, 0.0])
    batch = buf.take_batch(0)
    assert [g.group_id for g in batch] == ["g1", "g12"] and buf.rejected_in_a_row == 0
    s = check_invariant(buf)
    assert s["trained"] == 4 and s["dropped"] == {"filtered_zero_std": 22} and s["dropped_groups"] == 11


def test_the_learner_s_batch_is_whole_under_either_filter():
    """learner/loop/batches.py: zero_std's batch is groups_per_batch groups with a spread (the
    buffer drops the others as they complete); starpo_s takes more candidates and drops the
    lowest-ranked. Both count what they drop; neither steps on fewer groups than a batch."""
    from millstream.learner.loop.batches import group_test, take_batch
    from millstream.learner.loop.report import StepReport
    from millstream.shared.config import load_config

    for mode, extra in (("zero_std", []), ("starpo_s", ["learner.starpo_keep=0.5"])):
        cfg = load_config(
            None, ["train.groups_per_batch=2", "train.group_size=2", f"learner.group_filter={mode}", *extra]
        )
        buf = buffer(group_size=2, groups_per_batch=2, keep=group_test(cfg))
        report = StepReport(cfg, metrics=None)
        rewards = {"g0": [1.0, 1.0], "g1": [0.0, 1.0], "g2": [0.0, 0.5], "g3": [0.2, 0.2], "g4": [1.0, 0.0]}
        batches = []
        for gid, pair in rewards.items():
            for r in pair:
                buf.add(traj(gid, reward=r, group_size=2))
            batches.append([g.group_id for g in take_batch(buf, cfg, report, version=0)])
        s = check_invariant(buf)
        if mode == "zero_std":
            assert batches == [[], [], ["g1", "g2"], [], []] and s["dropped"] == {"filtered_zero_std": 4}
        else:  # 4 candidates, the 2 with the highest std kept (ties: the older)
            assert batches == [[], [], [], ["g1", "g2"], []] and s["dropped"] == {"filtered_starpo_s": 4}


def test_partial_group_is_not_returned_then_completes():
    buf = buffer(group_size=3)
    buf.add(traj("g", group_size=3))
    buf.add(traj("g", group_size=3))
    assert buf.take_batch(0) is None
    s = check_invariant(buf)
    assert groups(s) == (0, 1, 0) and s["buffered"] == 2
    buf.fail(failure("g", group_size=3))
    s = check_invariant(buf)
    assert groups(s) == (1, 0, 0)
    [group] = buf.take_batch(0)
    assert isinstance(group, Group)
    assert (group.group_id, len(group.trajectories), group.failed) == ("g", 2, 1)
    s = check_invariant(buf)
    assert (s["trained"], s["failed"], s["buffered"]) == (2, {"env_error": 1}, 0)


def test_oldest_version_is_min_over_generated_tokens_only():
    buf = buffer(group_size=2, max_staleness=10)
    buf.add(traj("g", group_size=2, versions=[5, 7]))  # prompt tokens carry version -1
    buf.add(traj("g", group_size=2, versions=[4, 6]))
    [group] = buf.take_batch(6)
    assert group.oldest_version == 4
    assert buf.statistics()["staleness"] == {"min": 2, "mean": 2.0, "max": 2}


def test_group_too_small_is_dropped_on_completion():
    buf = buffer(group_size=3, min_group_size=2)
    buf.add(traj("g", group_size=3))
    buf.fail(failure("g", group_size=3))
    buf.fail(failure("g", group_size=3, cause=Cause.ENV_TIMEOUT))
    s = check_invariant(buf)
    assert s["dropped"] == {"group_too_small": 1}
    assert s["failed"] == {"env_error": 1, "env_timeout": 1}
    assert groups(s) == (0, 0, 1) and s["buffered"] == 0
    assert buf.take_batch(0) is None


def test_batches_are_fifo_by_completion_not_by_arrival():
    buf = buffer(group_size=2, groups_per_batch=2, max_staleness=5)
    buf.add(traj("a", group_size=2))
    buf.add(traj("b", group_size=2))
    buf.add(traj("c", group_size=2))
    buf.add(traj("b", group_size=2))  # b completes first
    buf.add(traj("c", group_size=2))  # then c
    buf.add(traj("a", group_size=2))  # a opened first but completes last
    assert [g.group_id for g in buf.take_batch(0)] == ["b", "c"]
    assert buf.take_batch(0) is None  # only "a" is left: not a whole batch, nothing removed
    assert buf.statistics()["complete_groups"] == 1
    buf.add(traj("d", group_size=2))
    buf.add(traj("d", group_size=2))
    assert [g.group_id for g in buf.take_batch(0)] == ["a", "d"]


def test_stale_complete_groups_are_dropped_before_batching():
    buf = buffer(group_size=2, groups_per_batch=1, max_staleness=1)
    for gid, v in (("old", 0), ("new", 2)):
        buf.add(traj(gid, v, group_size=2))
        buf.add(traj(gid, v, group_size=2))
    [group] = buf.take_batch(3)  # "old" is 3 behind (> 1): dropped; "new" is 1 behind: kept
    assert group.group_id == "new"
    s = check_invariant(buf)
    assert s["dropped"] == {"stale": 2} and s["trained"] == 2 and s["dropped_groups"] == 1


def test_staleness_at_exactly_the_bound_is_kept():
    buf = buffer(group_size=1, min_group_size=1, max_staleness=2)
    buf.add(traj("g", 3, group_size=1))
    assert buf.take_batch(5) is not None


def test_stale_partial_group_and_its_late_members():
    buf = buffer(group_size=4, max_staleness=1, groups_per_batch=1)
    buf.add(traj("g", 0))
    buf.add(traj("g", 0))
    assert buf.take_batch(2) is None  # the partial group's arrived trajectories are stale
    s = check_invariant(buf)
    assert s["dropped"] == {"stale": 2} and groups(s) == (0, 0, 1)
    # A late member is stale on arrival even though its own tokens are fresh...
    buf.add(traj("g", 2))
    # ...and a late failure counts as a failure as usual.
    buf.fail(failure("g", cause=Cause.ENV_TIMEOUT))
    s = check_invariant(buf)
    assert s["dropped"] == {"stale": 3}
    assert s["failed"] == {"env_timeout": 1}
    assert groups(s) == (0, 0, 1) and s["buffered"] == 0  # late members are not a new group


def test_partial_group_of_only_failures_is_not_stale():
    buf = buffer(group_size=2, max_staleness=0)
    buf.fail(failure("g", group_size=2))
    assert buf.take_batch(100) is None
    assert buf.statistics()["partial_groups"] == 1
    buf.add(traj("g", 100, group_size=2))  # completes with 1 trajectory < min_group_size 2
    assert check_invariant(buf)["dropped"] == {"group_too_small": 1}


def test_duplicates_are_ignored_and_counted():
    buf = buffer(group_size=2)
    t = traj("g", group_size=2, episode="e1")
    buf.add(t)
    buf.add(t)
    buf.fail(failure("g", group_size=2, episode="e1"))  # same id as a trajectory: duplicate too
    s = check_invariant(buf)
    assert (s["received"], s["duplicates"], s["buffered"], s["partial_groups"]) == (1, 2, 1, 1)
    buf.fail(failure("h", group_size=2, episode="f1"))
    buf.fail(failure("h", group_size=2, episode="f1"))
    s = check_invariant(buf)
    assert s["failed"] == {"env_error": 1} and s["duplicates"] == 3


def test_member_beyond_group_size_is_dropped_as_overflow():
    buf = buffer(group_size=2)
    buf.add(traj("g", group_size=2))
    buf.add(traj("g", group_size=2))
    buf.add(traj("g", group_size=2))  # complete and still buffered
    buf.take_batch(0)
    buf.add(traj("g", group_size=2))  # already trained
    s = check_invariant(buf)
    assert s["dropped"] == {"group_overflow": 2} and s["partial_groups"] == 0


def test_malformed_trajectory_closes_its_slot():
    buf = buffer(group_size=3)
    bad = traj("g", group_size=3)  # no generated token: no staleness, nothing to train on
    buf.add(msgspec.structs.replace(bad, loss_mask=[0] * 4))
    for _ in range(2):
        buf.add(traj("g", group_size=3))
    assert check_invariant(buf)["dropped"] == {"malformed": 1}
    [group] = buf.take_batch(0)
    assert (len(group.trajectories), group.failed) == (2, 1)


def test_group_size_mismatch_raises_without_counting():
    buf = buffer(group_size=4)
    with pytest.raises(ValueError, match="group_size"):
        buf.add(traj("g", group_size=8))
    assert buf.statistics()["received"] == 0


def test_buffer_full_raises_naming_the_bound_and_keeps_accounts():
    buf = buffer(group_size=2, max_groups=2)
    buf.add(traj("a", group_size=2))
    buf.fail(failure("b", group_size=2))
    buf.add(traj("a", group_size=2))  # joining an existing group is fine
    before = check_invariant(buf)
    with pytest.raises(BufferFull, match="max_groups=2"):
        buf.add(traj("c", group_size=2))
    with pytest.raises(BufferFull):
        buf.fail(failure("c", group_size=2))
    assert issubclass(BufferFull, RuntimeError)
    assert check_invariant(buf) == before
    buf.take_batch(0)  # frees the slot of "a"
    buf.add(traj("c", group_size=2))
    assert buf.statistics()["partial_groups"] == 2


def test_drain_drops_everything_and_late_members_follow():
    buf = buffer(group_size=2, groups_per_batch=5)
    buf.add(traj("a", group_size=2))
    buf.add(traj("a", group_size=2))
    buf.add(traj("b", group_size=2))
    buf.fail(failure("c", group_size=2))
    assert buf.drain() == 3
    s = check_invariant(buf)
    assert s["dropped"] == {"run_ended": 3} and groups(s) == (0, 0, 3) and s["buffered"] == 0
    buf.add(traj("b", group_size=2))
    assert buf.statistics()["dropped"] == {"run_ended": 4}
    assert buf.drain("shutdown") == 0


def test_constructor_rejects_bad_shapes():
    with pytest.raises(ValueError, match="min_group_size"):
        buffer(group_size=2, min_group_size=3)
    with pytest.raises(ValueError, match="groups_per_batch=0"):
        buffer(groups_per_batch=0)


# --- the accounting invariant under random interleavings ---------------------------------------

# Like a real run, the policy version only grows and new groups open around the current version;
# episodes carry tokens up to 3 versions old. Ops: (kind, versions back of the group, lag or cause,
# re-send).
# Few open groups and rare re-sends, so that groups often complete and batches are trained.
_resend = st.integers(0, 5).map(lambda x: x == 0)
_back = st.sampled_from([0, 0, 0, 1, 2])  # mostly the current group, sometimes a late member
_add = st.tuples(st.just("add"), _back, st.integers(0, 3), _resend)
_fail = st.tuples(st.just("fail"), _back, st.sampled_from([Cause.ENV_ERROR, Cause.ENV_TIMEOUT]), _resend)
_op = st.one_of(
    _add, _add, _add, _fail, st.tuples(st.just("take"), st.integers(0, 1)), st.tuples(st.just("drain"))
)


@settings(max_examples=150, deadline=None)
@given(
    ops=st.lists(_op, min_size=5, max_size=60),
    group_size=st.integers(1, 3),
    groups_per_batch=st.integers(1, 2),
    max_staleness=st.integers(0, 2),
    min_group_size=st.integers(1, 3),
    max_groups=st.integers(1, 6),
)
def test_accounting_invariant_holds_at_every_step(
    ops, group_size, groups_per_batch, max_staleness, min_group_size, max_groups
):
    min_group_size = min(min_group_size, group_size)
    buf = ReplayBuffer(
        group_size=group_size,
        groups_per_batch=groups_per_batch,
        max_staleness=max_staleness,
        max_groups=max_groups,
        min_group_size=min_group_size,
    )
    sent: list[tuple[str, str]] = []
    arrivals: dict[str, int] = {}  # distinct episodes accepted per group (a small model)
    returned_ids: set[str] = set()
    returned = version = 0
    for op in ops:
        kind = op[0]
        try:
            if kind in ("add", "fail"):
                # Re-send the last episode now and then, to exercise duplicates (an id names its
                # group, as the run's `<gid>-e<m>` do: a re-send comes with the same group).
                gid, ep = sent[-1] if op[3] and sent else (f"g{version - op[1]}", f"e{len(sent)}")
                if kind == "add":
                    buf.add(traj(gid, max(0, version - op[2]), group_size=group_size, episode=ep))
                else:
                    buf.fail(failure(gid, cause=op[2], group_size=group_size, episode=ep))
                if (gid, ep) not in sent:
                    arrivals[gid] = arrivals.get(gid, 0) + 1
                sent.append((gid, ep))
            elif kind == "take":
                version += op[1]
                batch = buf.take_batch(version)
                if batch is not None:
                    assert len(batch) == groups_per_batch
                    for g in batch:
                        assert g.group_id not in returned_ids  # a group is never trained twice
                        returned_ids.add(g.group_id)
                        assert min_group_size <= len(g.trajectories)
                        assert len(g.trajectories) + g.failed == group_size
                        assert version - g.oldest_version <= max_staleness
                    returned += sum(len(g.trajectories) for g in batch)
            else:
                buf.drain()
        except BufferFull:
            pass
        s = check_invariant(buf)
        assert s["trained"] == returned
        assert s["complete_groups"] + s["partial_groups"] <= max_groups
        # A group whose members have all arrived is never left waiting.
        assert s["partial_groups"] <= sum(1 for n in arrivals.values() if n < group_size)
        # Every opened group is exactly one of: trained, dropped, buffered (never reopened).
        assert len(arrivals) == len(returned_ids) + sum(groups(s))
        assert s["buffered"] >= 0 and all(v > 0 for v in s["dropped"].values())
    buf.drain()
    s = check_invariant(buf)
    assert s["buffered"] == 0 and groups(s)[:2] == (0, 0)


def test_filtered_groups_are_discarded_with_their_cause():
    buf = ReplayBuffer(group_size=2, groups_per_batch=2, max_staleness=5, max_groups=10)
    for g in range(3):
        for e in range(2):
            buf.add(traj(f"g{g}", reward=float(e), group_size=2))
    assert buf.take_batch(0, count=4) is None
    batch = buf.take_batch(0, count=3)
    assert [g.group_id for g in batch] == ["g0", "g1", "g2"]
    buf.discard(batch[1:], DropCause.FILTERED_STARPO_S)
    stats = buf.statistics()
    assert stats["trained"] == 2 and stats["dropped"] == {"filtered_starpo_s": 4}
    assert stats["dropped_groups"] == 2 and stats["buffered"] == 0
    assert stats["received"] == stats["trained"] + sum(stats["dropped"].values())


# --- buffer_state / load_buffer_state (resume: learner/persist/replaystate.py) -----------------


def resumable_buffer() -> ReplayBuffer:
    """Trained g1; dropped g0 (stale) and g2 (too small); complete g3 then g2b; partial g7 (one
    trajectory) and g8 (one failure); a duplicate."""
    buf = buffer(group_size=2, groups_per_batch=1, max_staleness=2, max_groups=10)
    for g, version in (("g0", 0), ("g1", 3), ("g3", 3), ("g2", 4)):
        buf.add(traj(g, version, group_size=2))
        if g == "g2":
            buf.fail(failure(g, group_size=2))  # g2 completes with one trajectory (too small)
            buf.add(traj("g2b", 4, group_size=2))
            buf.add(traj("g2b", 4, group_size=2))
        else:
            buf.add(traj(g, version, group_size=2, episode=f"{g}-last"))
    assert [g.group_id for g in buf.take_batch(3) or []] == ["g1"]  # g0 is dropped as stale
    buf.add(traj("g7", 4, group_size=2))
    buf.fail(failure("g8", group_size=2, cause=Cause.ENV_TIMEOUT))  # partial with no trajectory
    buf.add(traj("g3", 3, group_size=2, episode="g3-last"))  # duplicate
    check_invariant(buf)
    return buf


def test_state_round_trips_through_msgpack_and_may_drop_partial_groups():
    buf = resumable_buffer()
    before = buf.statistics()
    assert groups(before) == (2, 2, 2)
    state = buffer_state(buf)
    raw = msgspec.msgpack.decode(msgspec.msgpack.encode(state))
    fresh = buffer(group_size=2, groups_per_batch=1, max_staleness=2, max_groups=10)
    assert load_buffer_state(fresh, raw, drop_partial_cause=DropCause.RUN_ENDED) == 2
    after = check_invariant(fresh)
    assert groups(after) == (2, 0, before["dropped_groups"] + 2)
    assert after["dropped"] == {**before["dropped"], "run_ended": 1}
    assert after["buffered"] == before["buffered"] - 1
    for key in ("received", "trained", "failed", "duplicates", "staleness"):
        assert after[key] == before[key], key
    # FIFO order kept; restored trajectories are real Trajectory structs, equal to the originals.
    fresh.add(traj("g3", 4, group_size=2, episode="g3-last"))  # re-sent while g3 is buffered
    batch = fresh.take_batch(4, count=2)
    assert [g.group_id for g in batch] == ["g3", "g2b"]
    assert batch[0].trajectories == state["complete"][0]["trajectories"]
    assert isinstance(batch[0].trajectories[0], Trajectory)
    # Seen ids and closed groups came back: a re-sent episode is a duplicate, a late member of
    # the dropped partial group is dropped under the resume cause, a trained group stays closed.
    fresh.add(traj("g7", 4, group_size=2))
    fresh.fail(failure("g8", group_size=2))
    fresh.fail(failure("g1", group_size=2))
    s = check_invariant(fresh)
    assert s["duplicates"] == before["duplicates"] + 1
    assert s["dropped"]["run_ended"] == 2
    assert s["failed"]["env_error"] == before["failed"]["env_error"] + 2
    assert groups(s)[:2] == (0, 0)
    # The in-memory state (not through msgpack) loads as well, and is a copy.
    other = buffer(group_size=2, groups_per_batch=1, max_staleness=2, max_groups=10)
    assert load_buffer_state(other, state) == 2
    assert other.statistics()["dropped"] == before["dropped"] and groups(other.statistics()) == groups(before)
    assert buf.statistics() == before


def test_partial_groups_survive_a_resume_and_complete_with_their_late_members():
    """What a learner restart needs: the workers still deliver a partial group's other members
    (envpool/redelivery.py), or close them as worker_lost."""
    buf = resumable_buffer()  # partial: g7 (one trajectory) and g8 (one failure)
    raw = msgspec.msgpack.decode(msgspec.msgpack.encode(buffer_state(buf)))
    fresh = buffer(group_size=2, groups_per_batch=1, max_staleness=2, max_groups=10)
    load_buffer_state(fresh, raw)
    assert groups(check_invariant(fresh)) == groups(buf.statistics())
    fresh.add(traj("g7", 4, group_size=2, episode="g7-late"))
    fresh.fail(failure("g8", group_size=2, cause=Cause.WORKER_LOST))
    fresh.add(traj("g7", 4, group_size=2, episode="g7-late"))  # sent again: a duplicate
    after = check_invariant(fresh)
    assert after["duplicates"] == buf.statistics()["duplicates"] + 1  # g7's member, sent twice
    assert after["partial_groups"] == 0 and after["complete_groups"] == 3  # g7 joins the batch queue
    assert after["dropped_groups"] == buf.statistics()["dropped_groups"] + 1  # g8: no trajectory
    assert [g.group_id for g in fresh.take_batch(4, count=3)] == ["g3", "g2b", "g7"]


def test_max_group_number_covers_every_group_seen():
    buf = buffer(group_size=2)
    assert buf.max_group_number() is None
    buf.add(traj("not-a-group", group_size=2))
    buf.add(traj("g12", group_size=2))
    assert buf.max_group_number() == 12  # partial
    buf.add(traj("g12", group_size=2))
    buf.add(traj("g3", group_size=2))
    buf.take_batch(0)  # g12 trained: still seen
    assert buf.max_group_number() == 12
    fresh = buffer(group_size=2)
    load_buffer_state(fresh, buffer_state(buf))  # g3 partial: dropped at load, still seen
    assert fresh.max_group_number() == 12 and buf.max_group_number() == 12


def test_load_buffer_state_refuses_mismatches():
    state = buffer_state(resumable_buffer())
    with pytest.raises(ValueError, match="group_size"):
        load_buffer_state(buffer(group_size=3), state)
    with pytest.raises(ValueError, match="format"):
        load_buffer_state(buffer(group_size=2), {**state, "format": 99})
    with pytest.raises(ValueError, match="max_groups"):
        load_buffer_state(buffer(group_size=2, max_groups=1), state)
    counters = state["counters"]
    bad = {**state, "counters": {**counters, "received": counters["received"] + 1}}
    target = buffer(group_size=2)
    with pytest.raises(ValueError, match="inconsistent"):
        load_buffer_state(target, bad)
    assert target.statistics()["received"] == 0  # nothing was changed


_resume_op = st.one_of(
    _add, _add, _add, _fail, st.tuples(st.just("take"), st.integers(0, 1)), st.tuples(st.just("resume"))
)


@settings(max_examples=100, deadline=None)
@given(
    ops=st.lists(_resume_op, min_size=5, max_size=60),
    group_size=st.integers(1, 3),
    max_staleness=st.integers(0, 2),
)
def test_accounting_holds_across_resumes(ops, group_size, max_staleness):
    def new() -> ReplayBuffer:
        return ReplayBuffer(
            group_size=group_size,
            groups_per_batch=1,
            max_staleness=max_staleness,
            max_groups=6,
            min_group_size=1,
        )

    buf, sent, version = new(), [], 0
    for op in ops:
        try:
            if op[0] in ("add", "fail"):
                ep = sent[-1] if op[3] and sent else f"e{len(sent)}"
                gid = f"g{version - op[1]}"
                if op[0] == "add":
                    buf.add(traj(gid, max(0, version - op[2]), group_size=group_size, episode=ep))
                else:
                    buf.fail(failure(gid, cause=op[2], group_size=group_size, episode=ep))
                sent.append(ep)
            elif op[0] == "take":
                version += op[1]
                buf.take_batch(version)
            else:
                before = check_invariant(buf)
                complete = [g.group_id for g in buf._complete.values()]
                fresh = new()
                raw = msgspec.msgpack.decode(msgspec.msgpack.encode(buffer_state(buf)))
                assert load_buffer_state(fresh, raw) == before["complete_groups"]
                after = check_invariant(fresh)
                assert after["received"] == before["received"]
                assert groups(after) == groups(before)  # partial groups wait on
                assert [g.group_id for g in fresh._complete.values()] == complete
                assert {gid: p.members for gid, p in fresh._pending.items()} == {
                    gid: p.members for gid, p in buf._pending.items()
                }
                assert fresh.max_group_number() == buf.max_group_number()
                buf = fresh
        except BufferFull:
            pass
        check_invariant(buf)


def test_drops_of_groups_below_the_floor_admit_nothing():
    """A restarted learner's view (learner/loop/leader.py `_all_greeted`): groups numbered below the
    floor were admitted by an earlier session."""
    buf = ReplayBuffer(group_size=2, groups_per_batch=1, max_staleness=0, max_groups=8)
    buf.floor = 10
    for gid in ("g5", "g12"):
        for i in range(2):
            buf.add(traj(gid, episode=f"{gid}-e{i}", group_size=2, reward=float(i)))
    assert buf.take_batch(version=5) is None  # both stale: dropped
    assert buf.dropped_groups == 2 and buf.dropped_from_floor == 1


# --- bounded memory (learner/seen.py) ------------------------------------------------------------


@given(st.lists(st.integers(0, 60), max_size=80))
def test_a_number_set_holds_what_was_added_as_few_ranges(numbers):
    from millstream.learner.seen import NumberSet

    kept = NumberSet()
    for n in numbers:
        kept.add(n)
    assert all((n in kept) == (n in set(numbers)) for n in range(-1, 62))
    ranges = kept.ranges()
    assert all(a < b for a, b in ranges) and all(b < c for (_, b), (c, _) in zip(ranges, ranges[1:]))
    assert NumberSet(ranges).ranges() == ranges


def test_a_long_run_keeps_the_ids_of_groups_in_flight_only():
    """50,016 episodes in 12,504 groups, some groups dropped stale with their late members
    arriving after: the ids held stay those of the groups in flight, finished groups are a
    handful of ranges, the checkpoint does not grow, and nothing reopens a finished group."""
    buf = buffer(group_size=4, groups_per_batch=4, max_staleness=1, max_groups=64)
    version, late = 0, []
    most_ids = 0
    for wave in range(0, 12_504, 8):
        for g in range(wave, wave + 8):
            members = [traj(f"g{g}", version, group_size=4, episode=f"g{g}-e{m}") for m in range(4)]
            if g % 50 == 0:  # two members now, two after the group was dropped as stale
                late += members[2:]
                members = members[:2]
            for t in members:
                assert buf.accept(t) is None
        most_ids = max(most_ids, len(buf._seen))
        while buf.take_batch(version):
            version += 1
        for t in late[:-4]:  # arrive a few waves later, after their group was dropped as stale
            buf.accept(t)
        late = late[-4:]
    s = check_invariant(buf)
    assert s["received"] == 12_504 * 4 - len(late) and s["dropped"]["stale"] > 0
    assert most_ids <= 64 * 4 and len(buf._seen) <= 64 * 4
    assert len(buf._closed) <= 64 and len(buf._seen._finished.ranges()) <= 64
    assert len(msgspec.msgpack.encode(buffer_state(buf))) < 200_000
    # A re-sent member of a long-finished group cannot reopen it: refused, counted, no group.
    before = buf.statistics()
    assert buf.accept(traj("g5", 0, group_size=4, episode="g5-e0")) == "group_finished"
    after = check_invariant(buf)
    assert after["received"] == before["received"] + 1 and after["partial_groups"] == before["partial_groups"]
    assert buf.max_group_number() == 12_503


def test_a_format_1_checkpoint_loads_and_forgets_its_finished_groups():
    """Format 1 kept every id of the run in one list and every closed group: loading it groups
    the ids by group and finishes the groups whose slots are all in (here g1, trained)."""
    state = buffer_state(resumable_buffer())
    ids = [e for group in state["seen"]["ids"].values() for e in group]
    old = {**state, "format": 1, "seen": sorted([*ids, "g1-e0", "g1-e1"])}
    old["closed"] = {**state["closed"], "g1": "group_overflow"}
    fresh = buffer(group_size=2, groups_per_batch=1, max_staleness=2, max_groups=10)
    assert load_buffer_state(fresh, old) == 2
    check_invariant(fresh)
    assert fresh._seen.finished("g1") and "g1" not in fresh._closed
    assert fresh.accept(traj("g1", 3, group_size=2, episode="g1-e0")) == "group_finished"
