"""Which groups make the next batch: the replay buffer's oldest fresh-enough complete groups, as
the group filter (`learner.group_filter`, docs/algorithms.md) lets them through.

The two filters work at different moments. `zero_std` tests each group on its own (a reward
spread, without which its advantages are all zero), so the buffer drops the groups that fail it
as they complete (`group_test`, `ReplayBuffer.keep`), and a batch is `groups_per_batch` groups
that pass: fewer wait for more, as DAPO's dynamic sampling does, instead of making a smaller
step. `starpo_s` ranks groups against
each other, so it takes more candidates than a batch and keeps the best of them.
"""

from __future__ import annotations

from collections.abc import Callable

from millstream.learner.groups import Group
from millstream.learner.loop.report import StepReport
from millstream.learner.replay import ReplayBuffer
from millstream.learner.train.advantages import filter_groups, filter_pool_size, has_reward_spread
from millstream.shared.config import Config
from millstream.shared.wire import DropCause

__all__ = ["FILTER_CAUSE", "take_batch", "group_test"]

#: The drop cause of groups each group filter removes.
FILTER_CAUSE = {"zero_std": DropCause.FILTERED_ZERO_STD, "starpo_s": DropCause.FILTERED_STARPO_S}


def group_test(cfg: Config) -> Callable[[Group], bool] | None:
    """The test the buffer applies to each group as it completes (`ReplayBuffer.keep`), if the
    filter is one of a group on its own (zero_std), else None."""
    return has_reward_spread if cfg.learner.group_filter == "zero_std" else None


def take_batch(buffer: ReplayBuffer, cfg: Config, report: StepReport, version: int) -> list[Group]:
    """The next batch for training at `version`, or [] while none is ready. Groups a filter
    drops are counted under its cause; `report` hears of zero_std's drops in a row."""
    candidates = buffer.take_batch(version, count=filter_pool_size(cfg.learner, cfg.train.groups_per_batch))
    report.rejected_in_a_row(buffer.rejected_in_a_row, version)
    if candidates is None:
        return []
    batch, rejected = filter_groups(candidates, cfg.learner)
    if rejected:
        buffer.discard(rejected, FILTER_CAUSE[cfg.learner.group_filter])
    return batch
