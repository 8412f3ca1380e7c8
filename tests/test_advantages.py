"""Tests of learner.train.advantages: hand-computed references, algebraic properties, filters."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from millstream.learner.replay import Group
from millstream.learner.train.advantages import (
    ESTIMATORS,
    compute_advantages,
    discounted_returns,
    drgrpo_advantages,
    filter_groups,
    filter_pool_size,
    group_advantages,
    grpo_advantages,
    ngrpo_advantages,
    rloo_advantages,
)
from millstream.shared.config import LearnerConfig
from millstream.shared.wire import Trajectory

ALL = ("grpo", "drgrpo", "rloo", "ngrpo", "gigpo")

# --- builders -------------------------------------------------------------------------------


def traj(turn_rewards, anchors=None, *, resp=2, obs=3, eid="e") -> Trajectory:
    """A consistent multi-turn trajectory: `obs` prompt/observation tokens (mask 0) before each
    turn's `resp` response tokens (mask 1), and one closing token (mask 0) at the end."""
    ids: list[int] = []
    mask: list[int] = []
    starts: list[int] = []
    ends: list[int] = []
    for _ in turn_rewards:
        ids += [7] * obs
        mask += [0] * obs
        starts.append(len(ids))
        ids += [9] * resp
        mask += [1] * resp
        ends.append(len(ids))
    ids.append(5)
    mask.append(0)
    turns = len(turn_rewards)
    return Trajectory(
        episode_id=eid,
        group_id="g0",
        seed=0,
        env="test",
        token_ids=ids,
        loss_mask=mask,
        logprobs=[-0.5 if m else 0.0 for m in mask],
        versions=[0 if m else -1 for m in mask],
        reward=math.fsum(turn_rewards),
        turn_rewards=list(turn_rewards),
        num_turns=turns,
        group_size=4,
        duration_s=0.0,
        turn_starts=starts,
        turn_ends=ends,
        anchors=list(anchors) if anchors is not None else [""] * turns,
    )


def group(*trajs: Trajectory, gid: str = "g0") -> Group:
    return Group(gid, list(trajs), 0, 0)


def cfg(**kw) -> LearnerConfig:
    return LearnerConfig(**kw)


def per_turn(t: Trajectory, adv: list[float]) -> list[float]:
    """The advantage of each turn, after checking it is constant over the turn's tokens."""
    out = []
    for s, e in zip(t.turn_starts, t.turn_ends):
        assert len(set(adv[s:e])) == 1, adv[s:e]
        out.append(adv[s])
    return out


def assert_masked(t: Trajectory, adv: list[float]) -> None:
    assert len(adv) == len(t.token_ids)
    assert all(a == 0.0 for a, m in zip(adv, t.loss_mask) if not m)


# --- scalar estimators ----------------------------------------------------------------------


def test_ragen_worked_example():
    # RAGEN: two rollouts with rewards 3.0 and 2.0: mean 2.5, population std 0.5 -> +1 / -1.
    a = grpo_advantages([3.0, 2.0])
    assert a == pytest.approx([1.0, -1.0], abs=1e-5)
    assert a[0] < 1.0  # eps is in the denominator


def test_ragen_worked_example_per_token():
    # The same example as token-level rewards (one per turn) summing to 3.0 and 2.0: +1 / -1 on
    # every response token, exactly 0 on the prompt, observation and closing tokens.
    a, b = traj([1.0, 2.0], eid="a"), traj([0.5, 1.5], eid="b")
    ((out_a, out_b),) = compute_advantages([group(a, b)], cfg(advantage="grpo"))
    for t, adv, sign in ((a, out_a, 1.0), (b, out_b, -1.0)):
        assert_masked(t, adv)
        assert [x for x, m in zip(adv, t.loss_mask) if m] == pytest.approx([sign] * 4, abs=1e-5)
        assert adv[:3] == [0.0, 0.0, 0.0] and adv[-1] == 0.0


def test_four_member_group_by_hand():
    # mean 1.0; deviations -1, -1, 1, 1; population variance 1 -> std 1 (sample std would be 1.155).
    assert grpo_advantages([0.0, 0.0, 2.0, 2.0], eps=0.0) == [-1.0, -1.0, 1.0, 1.0]
    # mean 2.5; deviations -2.5, -0.5, 0.5, 2.5; variance (6.25+0.25)*2/4 = 3.25.
    s = math.sqrt(3.25)
    assert grpo_advantages([0.0, 2.0, 3.0, 5.0], eps=0.0) == pytest.approx(
        [-2.5 / s, -0.5 / s, 0.5 / s, 2.5 / s]
    )


def test_drgrpo_is_mean_centering_only():
    assert grpo_advantages([0.0, 2.0, 3.0, 5.0], normalize_std=False) == [-2.5, -0.5, 0.5, 2.5]
    assert drgrpo_advantages([1.0, 0.0]) == [0.5, -0.5]
    assert ESTIMATORS["grpo"]([1.0, 0.0]) == grpo_advantages([1.0, 0.0])


def test_rloo_by_hand():
    # 0 - (2+4)/2 = -3; 2 - (0+4)/2 = 0; 4 - (0+2)/2 = 3.
    assert rloo_advantages([0.0, 2.0, 4.0]) == pytest.approx([-3.0, 0.0, 3.0])
    assert rloo_advantages([1.0, 0.0]) == pytest.approx([1.0, -1.0])
    assert rloo_advantages([5.0]) == [0.0] and rloo_advantages([]) == []
    assert rloo_advantages([0.1, 0.1, 0.1]) == [0.0, 0.0, 0.0]


def test_ngrpo_gives_signal_to_a_zero_std_group():
    # All wrong: [0,0,0,0] + virtual 1 -> mean 0.2, population var (4*0.04 + 0.64)/5 = 0.16.
    assert ngrpo_advantages([0.0] * 4, max_reward=1.0, eps=0.0) == pytest.approx([-0.5] * 4)
    assert grpo_advantages([0.0] * 4) == [0.0] * 4
    # All at the maximum: the virtual member changes nothing, exactly zero.
    assert ngrpo_advantages([1.0, 1.0], max_reward=1.0) == [0.0, 0.0]
    g = group(traj([0.0]), traj([0.0]), traj([0.0]), traj([0.0]))
    (ng,) = compute_advantages([g], cfg(advantage="ngrpo", ngrpo_max_reward=1.0))
    (gr,) = compute_advantages([g], cfg(advantage="grpo"))
    assert all(
        a == pytest.approx(-0.5, abs=1e-5) for t in ng for a, m in zip(t, g.trajectories[0].loss_mask) if m
    )
    assert all(a == 0.0 for t in gr for a in t)


def test_ngrpo_matches_the_papers_case_study_up_to_the_std_convention():
    # NGRPO's case study (8 responses, 1 correct): GRPO 2.47 / -0.35, NGRPO 1.76 / -0.50. Those
    # numbers use the sample std (ddof=1); ours is the population std, so convert by
    # sqrt((n-1)/n) with n = 8 members (GRPO) and n = 9 with the virtual one (NGRPO).
    r = [1.0] + [0.0] * 7
    g = [a * math.sqrt(7 / 8) for a in grpo_advantages(r, eps=0.0)]
    n = [a * math.sqrt(8 / 9) for a in ngrpo_advantages(r, max_reward=1.0, eps=0.0)]
    assert (g[0], g[1]) == pytest.approx((2.47, -0.35), abs=0.01)
    assert (n[0], n[1]) == pytest.approx((1.76, -0.50), abs=0.01)


def test_degenerate_groups():
    assert grpo_advantages([]) == []
    assert grpo_advantages([7.0]) == [0.0]
    # 0.1 * 3 is not exact in binary; equal rewards must still give exactly zero, not noise / eps.
    assert grpo_advantages([0.1, 0.1, 0.1]) == [0.0, 0.0, 0.0]
    assert grpo_advantages([0.1, 0.1], normalize_std=False) == [0.0, 0.0]
    assert ngrpo_advantages([]) == []


def _flat(reward: float) -> Trajectory:
    return Trajectory("e", "g", 0, "t", [0, 1], [0, 1], [0.0, -1.0], [-1, 0], reward, [reward], 1, 2, 0.0)


def test_group_advantages_per_group_in_trajectory_order():
    groups = [
        Group("a", [_flat(3.0), _flat(2.0)], 0, 0),
        Group("b", [_flat(1.0), _flat(1.0), _flat(4.0)], 1, 0),
    ]
    assert group_advantages(groups, "drgrpo") == [[0.5, -0.5], [-1.0, -1.0, 2.0]]
    assert group_advantages(groups)[0] == pytest.approx([1.0, -1.0], abs=1e-5)
    assert group_advantages(groups, "rloo")[1] == pytest.approx([-1.5, -1.5, 3.0])
    # [1, 1, 4] + virtual 4: mean 2.5, population std 1.5.
    assert group_advantages(groups, "ngrpo", max_reward=4.0)[1] == pytest.approx([-1, -1, 1], abs=1e-5)
    with pytest.raises(ValueError, match="unknown advantage estimator"):
        group_advantages(groups, "nope")


def test_discounted_returns():
    assert discounted_returns([0.0, 0.0, 1.0], 0.5) == [0.25, 0.5, 1.0]
    assert discounted_returns([1.0, 2.0], 1.0) == [3.0, 2.0]
    assert discounted_returns([], 0.9) == []


# --- turn level -----------------------------------------------------------------------------

# gamma 0.5: returns T1 [0.5, 1], T2 [1], T3 [0.25, 0.5, 1].
# Turn 0 compares all three, turn 1 only T1 and T3 (T2 ended), turn 2 only T3.
TURN_GROUP = ([0.0, 1.0], [1.0], [0.0, 0.0, 1.0])


def _turn_adv(advantage: str, **kw) -> list[list[float]]:
    trajs = [traj(r, eid=f"t{i}") for i, r in enumerate(TURN_GROUP)]
    (out,) = compute_advantages(
        [group(*trajs)], cfg(advantage=advantage, reward_level="turn", gamma=0.5, **kw)
    )
    for t, adv in zip(trajs, out):
        assert_masked(t, adv)
    return [per_turn(t, adv) for t, adv in zip(trajs, out)]


def test_turn_level_drgrpo_by_hand():
    m0 = (0.5 + 1.0 + 0.25) / 3  # turn 0 mean
    assert _turn_adv("drgrpo") == [
        pytest.approx([0.5 - m0, 1.0 - 0.75]),
        pytest.approx([1.0 - m0]),
        pytest.approx([0.25 - m0, 0.5 - 0.75, 0.0]),  # turn 2 has one member: 0
    ]


def test_turn_level_grpo_and_rloo_by_hand():
    s0 = math.sqrt(((0.5 - 7 / 12) ** 2 + (1 - 7 / 12) ** 2 + (0.25 - 7 / 12) ** 2) / 3)
    g = _turn_adv("grpo")
    assert g[0] == pytest.approx([(0.5 - 7 / 12) / s0, 1.0], abs=1e-5)
    assert g[1] == pytest.approx([(1 - 7 / 12) / s0], abs=1e-5)
    assert g[2] == pytest.approx([(0.25 - 7 / 12) / s0, -1.0, 0.0], abs=1e-5)
    # RLOO: 0.5 - (1 + 0.25)/2, 1 - (0.5 + 0.25)/2, 0.25 - (0.5 + 1)/2; turn 1: 1 - 0.5, 0.5 - 1.
    assert _turn_adv("rloo") == [
        pytest.approx([-0.125, 0.5]),
        pytest.approx([0.625]),
        pytest.approx([-0.5, -0.5, 0.0]),
    ]


def test_turn_level_ngrpo_lone_turn_still_gets_a_value():
    # Turn 2: [1.0] + virtual 2.0 -> mean 1.5, std 0.5 -> -1.
    assert _turn_adv("ngrpo", ngrpo_max_reward=2.0)[2][2] == pytest.approx(-1.0, abs=1e-5)


def test_single_turn_turn_level_equals_trajectory_level():
    g = group(traj([1.0]), traj([0.0]), traj([0.5]))
    for est in ("grpo", "drgrpo", "rloo", "ngrpo"):
        a = compute_advantages([g], cfg(advantage=est, reward_level="turn", gamma=0.7))
        b = compute_advantages([g], cfg(advantage=est, reward_level="trajectory"))
        assert a == b


# --- GiGPO ----------------------------------------------------------------------------------


def test_gigpo_by_hand():
    # Three episodes from one seed, gamma 0.5, step weight 0.5. Anchors repeat across episodes:
    #   T1: A -> B -> C, rewards 0, 0, 1   returns 0.25, 0.5, 1    R = 1
    #   T2: A -> B,      rewards 0, 0      returns 0,    0         R = 0
    #   T3: A -> D -> B, rewards 0, 0, 1   returns 0.25, 0.5, 1    R = 1  (reaches B late)
    t1 = traj([0.0, 0.0, 1.0], ["A", "B", "C"], eid="t1")
    t2 = traj([0.0, 0.0], ["A", "B"], eid="t2")
    t3 = traj([0.0, 0.0, 1.0], ["A", "D", "B"], eid="t3")
    (out,) = compute_advantages([group(t1, t2, t3)], cfg(advantage="gigpo", gamma=0.5, gigpo_step_weight=0.5))
    # Episode level: R = 1, 0, 1; mean 2/3, population std sqrt(2)/3 -> 1/sqrt2, -sqrt2, 1/sqrt2.
    e_hi, e_lo = 1 / math.sqrt(2), -math.sqrt(2)
    # Step group A: returns 0.25, 0, 0.25; mean 1/6, std 1/sqrt(72) -> 1/sqrt2, -sqrt2, 1/sqrt2.
    # Step group B: T1 t1 0.5, T2 t1 0, T3 t2 1; mean 0.5, std sqrt(1/6) -> 0, -sqrt1.5, sqrt1.5.
    # C and D are singletons: 0.
    a_hi, a_lo, b = 1 / math.sqrt(2), -math.sqrt(2), math.sqrt(1.5)
    assert per_turn(t1, out[0]) == pytest.approx([e_hi + 0.5 * a_hi, e_hi, e_hi], abs=1e-4)
    assert per_turn(t2, out[1]) == pytest.approx([e_lo + 0.5 * a_lo, e_lo - 0.5 * b], abs=1e-4)
    assert per_turn(t3, out[2]) == pytest.approx([e_hi + 0.5 * a_hi, e_hi, e_hi + 0.5 * b], abs=1e-4)
    for t, adv in zip((t1, t2, t3), out):
        assert_masked(t, adv)


def test_gigpo_empty_anchor_never_groups_and_weight_zero_is_grpo():
    t1, t2 = traj([1.0, 0.0], ["", ""]), traj([0.0, 0.0], ["", ""])
    (out,) = compute_advantages([group(t1, t2)], cfg(advantage="gigpo", gamma=1.0))
    (ref,) = compute_advantages([group(t1, t2)], cfg(advantage="grpo"))
    assert out == ref  # no step groups: episode advantage only
    t1, t2 = traj([1.0, 0.0], ["s", "s"]), traj([0.0, 0.0], ["s", "x"])
    (out,) = compute_advantages([group(t1, t2)], cfg(advantage="gigpo", gigpo_step_weight=0.0))
    assert out == ref


def test_inconsistent_turn_data_is_refused():
    bad = traj([1.0, 0.0], ["a"])  # one anchor for two turns
    good = traj([0.0, 0.0], ["a", "b"])
    with pytest.raises(ValueError, match="anchors"):
        compute_advantages([group(bad, good)], cfg(advantage="gigpo"))
    compute_advantages([group(bad, good)], cfg(advantage="grpo", reward_level="turn"))
    nospan = Trajectory("e9", "g", 0, "t", [0, 1], [0, 1], [0.0, -1.0], [-1, 0], 1.0, [1.0], 1, 2, 0.0)
    with pytest.raises(ValueError, match="e9.*span"):
        compute_advantages([group(nospan, good)], cfg(reward_level="turn"))
    compute_advantages([group(nospan, good)], cfg())  # trajectory level needs no spans
    nan = traj([float("nan")], eid="e7")
    with pytest.raises(ValueError, match="e7.*non-finite"):
        compute_advantages([group(nan, good)], cfg())


# --- properties -----------------------------------------------------------------------------

# Rewards on a quarter grid are exact in binary, so shifting them is exact too.
_reward = st.integers(-40, 40).map(lambda k: k / 4)
_rewards = st.lists(_reward, min_size=1, max_size=16)


@settings(max_examples=100, deadline=None)
@given(rewards=_rewards, shift=st.integers(-100, 100))
def test_invariant_to_a_constant_shift(rewards, shift):
    for fn in (grpo_advantages, drgrpo_advantages, rloo_advantages):
        assert fn([r + shift for r in rewards]) == pytest.approx(fn(rewards), abs=1e-9)


@settings(max_examples=100, deadline=None)
@given(rewards=_rewards, scale=st.floats(0.5, 100.0))
def test_scale_invariant_with_std_normalisation(rewards, scale):
    a = grpo_advantages(rewards, eps=0.0)
    assert grpo_advantages([r * scale for r in rewards], eps=0.0) == pytest.approx(a, rel=1e-9, abs=1e-9)
    # With the default eps the invariance is approximate (std is at least 0.125 on this grid).
    c = grpo_advantages([r * scale for r in rewards])
    assert c == pytest.approx(a, rel=1e-4, abs=1e-4)


@settings(max_examples=100, deadline=None)
@given(rewards=_rewards)
def test_sums_unit_scale_and_order(rewards):
    a = grpo_advantages(rewards)
    assert math.fsum(a) == pytest.approx(0.0, abs=1e-9)
    assert math.fsum(rloo_advantages(rewards)) == pytest.approx(0.0, abs=1e-9)
    n = len(rewards)
    if n > 1:  # RLOO is Dr.GRPO scaled by n / (n - 1)
        assert rloo_advantages(rewards) == pytest.approx(
            [n / (n - 1) * d for d in drgrpo_advantages(rewards)]
        )
    if len(set(rewards)) > 1:
        # Normalised to (nearly) unit population variance, and monotone in the reward.
        assert math.fsum(x * x for x in a) / n == pytest.approx(1.0, rel=1e-4)
        order = sorted(range(n), key=rewards.__getitem__)
        assert all(a[i] <= a[j] for i, j in zip(order, order[1:]))
    else:
        assert a == [0.0] * n and rloo_advantages(rewards) == [0.0] * n


@given(value=st.floats(-1e6, 1e6), n=st.integers(1, 10))
def test_zero_std_gives_zero(value, n):
    for fn in (grpo_advantages, drgrpo_advantages, rloo_advantages):
        assert fn([value] * n) == [0.0] * n


_traj = st.builds(
    lambda rs, an, resp, obs: traj(rs, an[: len(rs)], resp=resp, obs=obs),
    st.lists(_reward, min_size=1, max_size=4),
    st.lists(st.sampled_from(["a", "b", "c", ""]), min_size=4, max_size=4),
    st.integers(1, 3),
    st.integers(0, 2),
)


@settings(max_examples=60, deadline=None)
@given(
    groups=st.lists(st.lists(_traj, min_size=1, max_size=5), min_size=1, max_size=3),
    gamma=st.sampled_from([0.0, 0.5, 1.0]),
)
def test_shapes_and_masks_for_every_estimator_and_level(groups, gamma):
    gs = [group(*ts, gid=f"g{i}") for i, ts in enumerate(groups)]
    for est in ALL:
        for level in ("trajectory", "turn"):
            out = compute_advantages(gs, cfg(advantage=est, reward_level=level, gamma=gamma))
            assert len(out) == len(gs)
            for g, advs in zip(gs, out):
                assert len(advs) == len(g.trajectories)
                for t, adv in zip(g.trajectories, advs):
                    assert_masked(t, adv)
                    assert all(math.isfinite(a) for a in adv)
                    per_turn(t, adv)  # constant within each turn


@settings(max_examples=60, deadline=None)
@given(rewards=st.lists(_reward, min_size=1, max_size=8), shift=st.integers(-20, 20))
def test_grpo_per_token_invariant_to_shift(rewards, shift):
    a = compute_advantages([group(*(traj([r]) for r in rewards))], cfg())
    b = compute_advantages([group(*(traj([r + shift]) for r in rewards))], cfg())
    assert [x for t in b[0] for x in t] == pytest.approx([x for t in a[0] for x in t], abs=1e-9)


# --- filters --------------------------------------------------------------------------------


def _g(gid: str, *rewards: float) -> Group:
    return group(*(traj([r]) for r in rewards), gid=gid)


def _ids(groups: list[Group]) -> list[str]:
    return [g.group_id for g in groups]


def test_filter_none_and_zero_std():
    gs = [_g("a", 1, 1), _g("b", 0, 1), _g("c", 0.1, 0.1, 0.1), _g("d", 2), _g("e", 3, 0, 3)]
    kept, rejected = filter_groups(gs, cfg(group_filter="none"))
    assert _ids(kept) == list("abcde") and rejected == []
    kept, rejected = filter_groups(gs, cfg(group_filter="zero_std"))
    assert _ids(kept) == ["b", "e"] and _ids(rejected) == ["a", "c", "d"]


def test_starpo_s_ranking_ties_and_minimum():
    # Population stds: a 0, b 1, c 0.5, d 1, e 2, f 1. Keep round(6 * 0.5) = 3: e, then the
    # earliest of the tied b, d, f. Both lists keep candidate order.
    gs = [_g("a", 1, 1), _g("b", 0, 2), _g("c", 0, 1), _g("d", 2, 0), _g("e", 0, 4), _g("f", 3, 1)]
    kept, rejected = filter_groups(gs, cfg(group_filter="starpo_s", starpo_keep=0.5))
    assert _ids(kept) == ["b", "d", "e"] and _ids(rejected) == ["a", "c", "f"]
    kept, rejected = filter_groups(gs[:2], cfg(group_filter="starpo_s", starpo_keep=0.1))
    assert _ids(kept) == ["b"] and _ids(rejected) == ["a"]  # at least one
    assert filter_groups([], cfg(group_filter="starpo_s")) == ([], [])
    kept, _ = filter_groups(gs, cfg(group_filter="starpo_s", starpo_keep=1.0))
    assert _ids(kept) == list("abcdef")


def test_filter_pool_size():
    assert filter_pool_size(cfg(group_filter="starpo_s", starpo_keep=0.75), 4) == 6
    assert filter_pool_size(cfg(group_filter="starpo_s", starpo_keep=0.25), 4) == 16
    assert filter_pool_size(cfg(group_filter="starpo_s", starpo_keep=1.0), 4) == 4
    assert filter_pool_size(cfg(group_filter="starpo_s", starpo_keep=0.3), 3) == 10  # not 11
    assert filter_pool_size(cfg(group_filter="none"), 4) == 4
    assert filter_pool_size(cfg(group_filter="zero_std"), 5) == 5


@given(b=st.integers(1, 64), pct=st.integers(1, 100))
def test_starpo_pool_keeps_at_least_a_batch(b, pct):
    c = cfg(group_filter="starpo_s", starpo_keep=pct / 100)
    pool = filter_pool_size(c, b)
    kept, rejected = filter_groups([_g(f"g{i}", 0, i) for i in range(pool)], c)
    assert len(kept) >= b and len(kept) + len(rejected) == pool
