"""Per-step statistics and the collapse warning."""

from millstream.learner.stats import CollapseWatch


def test_collapse_warning_fires_once_when_std_and_entropy_fall_together():
    watch = CollapseWatch(window=3, ratio=0.5)
    fired = [watch.update(0.3, 2.0) for _ in range(6)]
    fired += [watch.update(0.05, 0.5) for _ in range(6)]
    warnings = [f for f in fired if f]
    assert len(warnings) == 1
    assert warnings[0]["reward_std"] < 0.5 * warnings[0]["reward_std_peak"]


def test_no_warning_when_only_one_signal_falls():
    watch = CollapseWatch(window=3, ratio=0.5)
    assert not any(watch.update(0.3, 2.0) for _ in range(6))
    assert not any(watch.update(0.01, 1.9) for _ in range(10))  # entropy holds: no collapse
