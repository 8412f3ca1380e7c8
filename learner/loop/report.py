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

from millstream.learner.episodes.experience import say
from millstream.learner.stats import CollapseWatch, NoSignalWatch, progress_line
from millstream.shared.config import Config
from millstream.shared.obs.dashboards import DashboardMetrics

__all__ = ["StepReport"]

log = logging.getLogger("learner")


class StepReport:
    """Writes each step's record to `metrics` and raises the no-signal and collapse warnings."""

    def __init__(self, cfg: Config, metrics: DashboardMetrics) -> None:
        self.cfg, self.metrics = cfg, metrics
        self.collapse = CollapseWatch()
        self.no_signal = NoSignalWatch()

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
        say(progress_line(record, self.cfg.train.steps, no_signal_after=self.no_signal.after))

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
