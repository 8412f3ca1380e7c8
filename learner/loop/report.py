"""What the learner says after each step: the metrics record, its warnings, the progress line.

Two watches run over the steps (learner/stats.py): `NoSignalWatch` counts batches in a row whose
every group had equal rewards (no learning signal), `CollapseWatch` warns when the reward spread
and the policy's entropy fall together. A warning goes three ways: a log line (stderr), an event
record in the metrics, and, where an operator should see it, a line on standard output, which
otherwise carries one progress line per step and nothing else (the launcher shows it as is).

A batch the group filter drops whole takes no step, so it has no record and no progress line:
`no_batch` says on standard output what the step line would have said.
"""

from __future__ import annotations

import logging
from collections import deque
from pathlib import Path

from millstream.learner.episodes.experience import say
from millstream.learner.stats import CollapseWatch, NoSignalWatch, progress_line
from millstream.shared.config import Config
from millstream.shared.obs.dashboards import DashboardMetrics
from millstream.shared.obs.metrics import read_jsonl

__all__ = ["StepReport", "elapsed_before"]

#: Steps the pace (steps/min, ETA) is measured over: recent enough to follow a change of speed,
#: long enough not to swing with one slow step (a checkpoint, an evaluation round).
PACE_WINDOW = 5

log = logging.getLogger("learner")


class StepReport:
    """Writes each step's record to `metrics` and raises the no-signal and collapse warnings."""

    def __init__(self, cfg: Config, metrics: DashboardMetrics) -> None:
        self.cfg, self.metrics = cfg, metrics
        self.collapse = CollapseWatch()
        self.no_signal = NoSignalWatch()
        self._rejected_batches = 0  # batches' worth of groups zero_std dropped in a row, reported
        self.recent: deque[tuple[int, float]] = deque(maxlen=PACE_WINDOW + 1)  # (step, elapsed_s)

    def pace(self, step: int, elapsed_s: float) -> float | None:
        """Steps per minute over the last PACE_WINDOW steps (None before the second step: the
        first one's time is mostly start-up)."""
        self.recent.append((step, elapsed_s))
        (first, start), (last, end) = self.recent[0], self.recent[-1]
        return (last - first) / (end - start) * 60 if last > first and end > start else None

    def step(self, record: dict, step_metrics: dict[str, float], step: int) -> None:
        """The step's metrics record, its warnings and its progress line."""
        quiet = self.no_signal.update(record["reward/frac_zero_std_groups"])
        record["warning/no_signal_steps"] = quiet
        self.metrics.write(record)
        if quiet == self.no_signal.after:
            log.warning("no learning signal: every group of the last %d batches had equal rewards", quiet)
            self.metrics.write({"event": "no_signal_warning", "step": step, "steps": quiet})
        warning = self.collapse.update(record["reward/std"], step_metrics.get("entropy"))
        if warning:
            log.warning("collapse warning at step %d: %s", step, warning)
            say(
                f"warning: reward std and entropy collapsing at step {step} "
                f"(std {warning['reward_std']:.3f} from {warning['reward_std_peak']:.3f}, entropy "
                f"{warning['entropy']:.2f} from {warning['entropy_peak']:.2f})"
            )
            self.metrics.write({"event": "collapse_warning", "step": step, **warning})
        pace = self.pace(step, record["perf/elapsed_s"])
        say(progress_line(record, self.cfg.train.steps, self.no_signal.after, steps_per_min=pace))

    def rejected_in_a_row(self, groups: int, step: int) -> None:
        """zero_std drops groups without a reward spread in the buffer (the batch waits for
        groups_per_batch with one): each groups_per_batch of them in a row, with none that had
        a spread, is a batch without signal (`no_batch`)."""
        batches = groups // self.cfg.train.groups_per_batch
        if batches < self._rejected_batches:  # a group with a spread came: a new streak
            self._rejected_batches = self.no_signal.streak = 0
        while self._rejected_batches < batches:
            self._rejected_batches += 1
            self.no_batch(step)

    def no_batch(self, step: int) -> None:
        """The group filter dropped a whole batch (no group had a reward spread): no step, so no
        step line either; say it here, as the step line would."""
        quiet = self.no_signal.update(1.0)
        after = self.no_signal.after
        if quiet >= after and (quiet == after or quiet % 10 == 0):
            say(
                f"NO SIGNAL: {quiet} batches in a row had equal rewards in every group (all dropped "
                f"by learner.group_filter={self.cfg.learner.group_filter}); no step was taken"
            )
            self.metrics.write({"event": "no_signal_warning", "step": step, "batches": quiet})


def elapsed_before(run_dir: str | Path, step: int) -> float:
    """The run's elapsed time at `step` by its metrics (0 if none): a resumed run's clock goes on
    from there, so its elapsed time and pace are the run's, not the session's."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return 0.0
    at = [
        r["perf/elapsed_s"]
        for r in read_jsonl(path)
        if r.get("step") == step and "perf/elapsed_s" in r and not r.get("rolled_back")
    ]
    return float(at[-1]) if at else 0.0
