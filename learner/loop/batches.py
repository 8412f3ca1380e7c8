"""Which groups make the next batch: the replay buffer's oldest fresh-enough complete groups, as
the group filter (`learner.group_filter`, docs/algorithms.md) lets them through.

The two filters work at different moments. `zero_std` tests each group on its own (a reward
spread, without which its advantages are all zero), so the buffer drops the groups that fail it
as they complete, and a batch is `groups_per_batch` groups that pass: fewer wait for more, as
DAPO's dynamic sampling does, instead of making a smaller step. `starpo_s` ranks groups against
each other, so it takes more candidates than a batch and keeps the best of them.
"""

from __future__ import annotations

from millstream.learner.groups import Group
from millstream.learner.loop.report import StepReport
from millstream.learner.replay import ReplayBuffer
from millstream.learner.train.advantages import filter_groups, filter_pool_size, has_reward_spread
from millstream.shared.config import Config
from millstream.shared.wire import DropCause

__all__ = ["FILTER_CAUSE", "take_batch"]

#: The drop cause of groups each group filter removes.
FILTER_CAUSE = {"zero_std": DropCause.FILTERED_ZERO_STD, "starpo_s": DropCause.FILTERED_STARPO_S}


def take_batch(buffer: ReplayBuffer, cfg: Config, report: StepReport, version: int) -> list[Group]:
    """The next batch for training at `version`, or [] while none is ready. Groups a filter
    drops are counted under its cause; `report` hears of zero_std's drops in a row."""
    one_by_one = cfg.learner.group_filter == "zero_std"
    candidates = buffer.take_batch(
        version,
        count=filter_pool_size(cfg.learner, cfg.train.groups_per_batch),
        keep=has_reward_spread if one_by_one else None,
        cause=DropCause.FILTERED_ZERO_STD,
    )
    report.rejected_in_a_row(buffer.rejected_in_a_row, version)
    if candidates is None:
        return []
    batch, rejected = filter_groups(candidates, cfg.learner)
    if rejected:
        buffer.discard(rejected, FILTER_CAUSE[cfg.learner.group_filter])
    return batch
