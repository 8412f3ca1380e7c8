"""Per-step statistics and the collapse warning."""

from millstream.learner.stats import CollapseWatch, NoSignalWatch, progress_line


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


def test_no_signal_counts_steps_whose_every_group_had_equal_rewards():
    watch = NoSignalWatch(after=3)
    assert [watch.update(f) for f in (1.0, 1.0, 0.75, 1.0, 1.0, 1.0, 1.0)] == [1, 2, 0, 1, 2, 3, 4]


def test_the_step_line_says_no_signal_after_enough_steps():
    record = {
        "step": 7,
        "reward/mean": 0.0,
        "reward/std": 0.0,
        "staleness/min": 0,
        "staleness/mean": 0.0,
        "staleness/max": 0,
        "perf/tokens_per_s": 10.0,
        "sync/total_s": 0.1,
        "perf/elapsed_s": 9.0,
        "episodes/failed/env_error": 2,
    }
    assert "NO SIGNAL" not in progress_line({**record, "warning/no_signal_steps": 2}, 10)
    line = progress_line({**record, "warning/no_signal_steps": 3}, 10)
    assert line.endswith("| NO SIGNAL: equal rewards in every group for 3 steps")
    assert "failed 2" in line


def test_the_step_line_gives_the_pace_and_the_time_left():
    record = {
        "step": 8,
        "reward/mean": 0.5,
        "reward/std": 0.1,
        "staleness/min": 0,
        "staleness/mean": 0.5,
        "staleness/max": 1,
        "perf/tokens_per_s": 10.0,
        "sync/total_s": 0.1,
        "perf/elapsed_s": 90.0,
    }
    assert "ETA" not in progress_line(record, 20)  # no pace known yet (the first step)
    assert progress_line(record, 20, steps_per_min=4.0).endswith("| 4.0 steps/min, ETA 3m00s")
    assert progress_line(record, 1000, steps_per_min=4.0).endswith("ETA 4h08m")


def test_the_pace_is_measured_over_recent_steps_and_a_resume_keeps_the_runs_clock(tmp_path):
    from millstream.learner.loop.report import PACE_WINDOW, StepReport, elapsed_before
    from millstream.shared.config import load_config

    report = StepReport(load_config(None, []), metrics=None)
    assert report.pace(1, 60.0) is None  # step 1 carries the start-up
    assert report.pace(2, 70.0) == 6.0  # 1 step in 10 s
    for step in range(3, 3 + PACE_WINDOW):  # then 30 s a step: the start-up falls out of the window
        pace = report.pace(step, 70.0 + 30 * (step - 2))
    assert pace == 2.0
    (tmp_path / "metrics.jsonl").write_text(
        '{"step": 4, "perf/elapsed_s": 120.5}\n'
        '{"event": "checkpoint", "step": 4}\n'
        '{"step": 5, "perf/elapsed_s": 150.0, "rolled_back": true}\n'
    )
    assert elapsed_before(tmp_path, 4) == 120.5 and elapsed_before(tmp_path, 5) == 0.0
    assert elapsed_before(tmp_path / "nowhere", 4) == 0.0


def test_a_batch_s_worth_of_groups_without_signal_in_a_row_is_said(capsys):
    """zero_std drops groups without a spread in the buffer, so no batch ever comes when none has
    one: each groups_per_batch of them in a row counts as a batch without signal, and the
    third in a row is said on standard output (then every tenth), as before the filter moved."""
    from millstream.learner.loop.report import StepReport
    from millstream.shared.config import load_config

    class Recorded:
        def __init__(self) -> None:
            self.records: list[dict] = []

        def write(self, record: dict) -> None:
            self.records.append(record)

    metrics = Recorded()
    report = StepReport(
        load_config(None, ["train.groups_per_batch=2", "learner.group_filter=zero_std"]), metrics=metrics
    )
    for step, in_a_row in enumerate((1, 2, 3, 5, 0, 2, 4, 6)):  # a group with a spread at the 0
        report.rejected_in_a_row(in_a_row, step=step)
    said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("NO SIGNAL")]
    assert said == [
        "NO SIGNAL: 3 batches in a row had equal rewards in every group (all dropped by "
        "learner.group_filter=zero_std); no step was taken"
    ]
    assert [(r["step"], r["batches"]) for r in metrics.records] == [(7, 3)]  # the streak began anew
