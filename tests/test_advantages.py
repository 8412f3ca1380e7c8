"""Tests of learner.advantages: hand-computed references and algebraic properties."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from learner.advantages import ESTIMATORS, group_advantages, grpo_advantages
from learner.replay import Group
from shared.protocol import Trajectory


def test_ragen_worked_example():
    # RAGEN: two rollouts with rewards 3.0 and 2.0: mean 2.5, population std 0.5 -> +1 / -1.
    a = grpo_advantages([3.0, 2.0])
    assert a == pytest.approx([1.0, -1.0], abs=1e-5)
    assert a[0] < 1.0  # eps is in the denominator


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
    assert ESTIMATORS["drgrpo"]([1.0, 0.0]) == [0.5, -0.5]
    assert ESTIMATORS["grpo"]([1.0, 0.0]) == grpo_advantages([1.0, 0.0])


def test_degenerate_groups():
    assert grpo_advantages([]) == []
    assert grpo_advantages([7.0]) == [0.0]
    # 0.1 * 3 is not exact in binary; equal rewards must still give exactly zero, not noise / eps.
    assert grpo_advantages([0.1, 0.1, 0.1]) == [0.0, 0.0, 0.0]
    assert grpo_advantages([0.1, 0.1], normalize_std=False) == [0.0, 0.0]


def _traj(reward: float) -> Trajectory:
    return Trajectory("e", "g", 0, "t", [0, 1], [0, 1], [0.0, -1.0], [-1, 0], reward, [reward], 1,
                      2, 0.0)


def test_group_advantages_per_group_in_trajectory_order():
    groups = [Group("a", [_traj(3.0), _traj(2.0)], 0, 0),
              Group("b", [_traj(1.0), _traj(1.0), _traj(4.0)], 1, 0)]
    out = group_advantages(groups, "drgrpo")
    assert out == [[0.5, -0.5], [-1.0, -1.0, 2.0]]
    assert group_advantages(groups)[0] == pytest.approx([1.0, -1.0], abs=1e-5)
    with pytest.raises(ValueError, match="unknown advantage estimator"):
        group_advantages(groups, "nope")


# Rewards on a quarter grid are exact in binary, so shifting them is exact too.
_rewards = st.lists(st.integers(-40, 40).map(lambda k: k / 4), min_size=1, max_size=16)


@settings(max_examples=200, deadline=None)
@given(rewards=_rewards, shift=st.integers(-100, 100))
def test_invariant_to_a_constant_shift(rewards, shift):
    for norm in (True, False):
        a = grpo_advantages(rewards, normalize_std=norm)
        b = grpo_advantages([r + shift for r in rewards], normalize_std=norm)
        assert b == pytest.approx(a, abs=1e-9)


@settings(max_examples=200, deadline=None)
@given(rewards=_rewards, scale=st.floats(0.5, 100.0))
def test_scale_invariant_with_std_normalisation(rewards, scale):
    a = grpo_advantages(rewards, eps=0.0)
    b = grpo_advantages([r * scale for r in rewards], eps=0.0)
    assert b == pytest.approx(a, rel=1e-9, abs=1e-9)
    # With the default eps the invariance is approximate (std is at least 0.125 on this grid).
    c = grpo_advantages([r * scale for r in rewards])
    assert c == pytest.approx(a, rel=1e-4, abs=1e-4)


@settings(max_examples=200, deadline=None)
@given(rewards=_rewards)
def test_sum_to_zero_unit_scale_and_order(rewards):
    a = grpo_advantages(rewards)
    assert len(a) == len(rewards)
    assert math.fsum(a) == pytest.approx(0.0, abs=1e-9)
    if len(set(rewards)) > 1:
        # Normalised to (nearly) unit population variance, and monotone in the reward.
        assert math.fsum(x * x for x in a) / len(a) == pytest.approx(1.0, rel=1e-4)
        order = sorted(range(len(rewards)), key=rewards.__getitem__)
        assert all(a[i] <= a[j] for i, j in zip(order, order[1:]))
    else:
        assert a == [0.0] * len(rewards)


@given(value=st.floats(-1e6, 1e6), n=st.integers(1, 10))
def test_zero_std_gives_zero(value, n):
    assert grpo_advantages([value] * n) == [0.0] * n
    assert grpo_advantages([value] * n, normalize_std=False) == [0.0] * n
