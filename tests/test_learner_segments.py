"""The learner trains each context of a trajectory as its own sequence (`train_samples`).

A trajectory with `segment_starts` (Delethink chunks, AgentFlow's fresh module calls) is the
concatenation of independent contexts; each becomes one `TrainSample` with the matching slices of
ids, mask, behaviour logprobs and advantages, and a context without any trained token (only
untrained turns, or a prompt only) is left out.
"""

from __future__ import annotations

from millstream.learner.train.batching import train_samples
from millstream.learner.train.trainer import TrainSample
from millstream.shared.wire import Trajectory


def make_traj(mask: list[int], segment_starts: list[int]) -> Trajectory:
    n = len(mask)
    return Trajectory(
        episode_id="e0",
        group_id="g0",
        seed=1,
        env="test",
        token_ids=[100 + i for i in range(n)],
        loss_mask=mask,
        logprobs=[-(i + 1) / 10 if m else 0.0 for i, m in enumerate(mask)],
        versions=[2 if m else -1 for m in mask],
        reward=1.0,
        turn_rewards=[1.0],
        num_turns=1,
        group_size=1,
        duration_s=0.1,
        segment_starts=segment_starts,
    )


def advantages_for(n: int) -> list[float]:
    return [0.5 + i for i in range(n)]


def slice_of(traj: Trajectory, adv: list[float], a: int, b: int) -> TrainSample:
    return TrainSample(traj.token_ids[a:b], traj.loss_mask[a:b], traj.logprobs[a:b], adv[a:b])


def test_without_segments_the_whole_trajectory_is_one_sample():
    mask = [0, 0, 0, 1, 1, 0, 0, 1, 1, 1]
    traj, adv = make_traj(mask, []), advantages_for(10)
    samples = train_samples(traj, adv)
    assert samples == [TrainSample(list(range(100, 110)), mask, traj.logprobs, adv)]
    assert samples[0].behav_logprobs[3] == -0.4 and samples[0].advantages[9] == 9.5


def test_each_segment_is_its_own_sample():
    #       seg 0: [0, 5)     seg 1: [5, 12)             seg 2: [12, 16)
    mask = [0, 0, 1, 1, 1] + [0, 0, 0, 0, 1, 1, 1] + [0, 0, 0, 1]
    traj, adv = make_traj(mask, [5, 12]), advantages_for(16)
    samples = train_samples(traj, adv)
    assert samples == [slice_of(traj, adv, 0, 5), slice_of(traj, adv, 5, 12), slice_of(traj, adv, 12, 16)]
    assert [s.token_ids[0] for s in samples] == [100, 105, 112]
    assert [len(s.token_ids) for s in samples] == [5, 7, 4]
    # Every token lands in exactly one sample, in order.
    assert [t for s in samples for t in s.token_ids] == traj.token_ids
    assert [a for s in samples for a in s.advantages] == adv


def test_a_segment_without_trained_tokens_is_skipped():
    # The middle context holds an untrained turn only (e.g. AgentFlow's executor).
    mask = [0, 0, 1, 1] + [0, 0, 0, 0, 0] + [0, 1, 1]
    traj, adv = make_traj(mask, [4, 9]), advantages_for(12)
    assert train_samples(traj, adv) == [slice_of(traj, adv, 0, 4), slice_of(traj, adv, 9, 12)]


def test_an_untrained_first_context_and_a_prompt_only_last_one_are_skipped():
    mask = [0, 0, 0] + [0, 1, 1] + [0, 0]
    traj, adv = make_traj(mask, [3, 6]), advantages_for(8)
    assert train_samples(traj, adv) == [slice_of(traj, adv, 3, 6)]


def test_nothing_trained_gives_no_sample():
    traj = make_traj([0] * 6, [2, 4])
    assert train_samples(traj, advantages_for(6)) == []
    assert train_samples(make_traj([0] * 6, []), advantages_for(6)) == []
