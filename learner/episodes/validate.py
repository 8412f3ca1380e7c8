"""What the learner checks on every arriving episode before the replay buffer takes it.

Anything that can push to the experience socket reaches the learner, and the learner used to trust
it: a NaN or 1e308 reward, a group_size that disagreed with its group's, or more groups than the
buffer holds each ended the run, and a forged group with reward 1e9 was trained on. Now each
`Trajectory` and `EpisodeFailed` is checked here first. A refused one is still an episode: the
buffer counts it as received and dropped under `invalid_trajectory`, with the reason kept in a
per-reason counter (`ReplayBuffer.refused`), so the accounting identity holds and nothing is lost
silently (`learner/replay.py`).

Two kinds of reasons, because they decide whether the episode may close a slot of its group:

- *content* (bad reward, token lists of different lengths, a version from the future, ids
  outside the vocabulary, turn spans the advantages cannot place): the message names its group
  consistently, so it closes its member slot like a failure and the rest of the group still
  completes.
- *identity* (`IDENTITY_REASONS`: a group id that is not `g<number>`, or one the learner never
  admitted): it is counted and touches no group, so a forged message cannot complete, block or
  open a group. The buffer adds its own identity checks (group size, environment and seed
  disagreeing with the group, a full buffer).

"Never admitted" means a number at or above the highest `admit_limit` announced so far: no
envpool worker can have started that group (envpool/gate.py). The limit only grows within a
session, so the highest one is the bound.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from millstream.learner.train.advantages import span_problem
from millstream.shared.config import LearnerConfig
from millstream.shared.wire import EpisodeFailed, Trajectory, group_number

__all__ = ["Refusal", "EpisodeCheck", "IDENTITY_REASONS", "vocab_size"]

#: The lowest version a relabeled trajectory may carry (learner/episodes/intake.py: a token of
#: an abandoned timeline further from this policy than its version is labeled below -1).
RELABELED_LOWEST = -(2**62)

#: Reasons that say the message does not belong to the group it names: it closes no slot.
IDENTITY_REASONS = frozenset({"bad_group_id", "unannounced_group"})


@dataclass(frozen=True)
class Refusal:
    """Why an episode is refused: a short `reason` (a metric key) and words for the log."""

    reason: str
    detail: str

    @property
    def closes_slot(self) -> bool:
        return self.reason not in IDENTITY_REASONS


def vocab_size(model_dir: str | Path) -> int:
    """The model's vocabulary size, from its config.json."""
    return int(json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"])


class EpisodeCheck:
    """Checks arriving episodes against the run's config, the vocabulary and the learner's state."""

    def __init__(self, cfg: LearnerConfig, vocab: int) -> None:
        self.cfg = cfg
        self.low, self.high = cfg.reward_range
        self.vocab = vocab

    def problem(
        self, message: Trajectory | EpisodeFailed, *, version: int, admitted: int, relabeled: bool = False
    ) -> Refusal | None:
        """What is wrong with `message`, or None. `version`: the learner's policy version now;
        `admitted`: the highest admission limit announced so far; `relabeled`: the learner moved
        its versions onto this session's timeline (learner/episodes/intake.py), and a generated
        token further from this policy than its version is labeled below -1."""
        try:
            number = group_number(message.group_id)
        except ValueError:
            return Refusal("bad_group_id", f"group id {message.group_id[:40]!r} is not g<number>")
        if number >= admitted:
            return Refusal("unannounced_group", f"group {number} was never admitted (limit {admitted})")
        if isinstance(message, Trajectory):
            return self._content(message, version, RELABELED_LOWEST if relabeled else -1)
        return None

    def _content(self, traj: Trajectory, version: int, lowest: int) -> Refusal | None:
        n = len(traj.token_ids)
        if n == 0 or not len(traj.loss_mask) == len(traj.logprobs) == len(traj.versions) == n:
            return Refusal(
                "lengths",
                f"{n} tokens, {len(traj.loss_mask)} mask, {len(traj.logprobs)} logprobs, "
                f"{len(traj.versions)} versions",
            )
        rewards = (traj.reward, *traj.turn_rewards)
        if not all(math.isfinite(r) for r in rewards):
            return Refusal("reward_not_finite", f"reward {traj.reward!r}, turn rewards not all finite")
        if not all(self.low <= r <= self.high for r in rewards):
            return Refusal("reward_out_of_range", f"reward {traj.reward!r} outside {self.cfg.reward_range}")
        if any(m not in (0, 1) for m in traj.loss_mask):
            return Refusal("loss_mask", "loss_mask holds values other than 0 and 1")
        if not all(math.isfinite(lp) and lp <= 1e-3 for lp in traj.logprobs):
            return Refusal("logprobs", "a logprob is not finite or is above 0")
        if max(traj.versions) > version or min(traj.versions) < lowest:
            return Refusal(
                "version", f"versions in [{min(traj.versions)}, {max(traj.versions)}], learner at {version}"
            )
        if min(traj.token_ids) < 0 or max(traj.token_ids) >= self.vocab:
            return Refusal("token_id", f"token ids outside the vocabulary [0, {self.vocab})")
        starts = traj.segment_starts
        if any(not 0 < s < n for s in starts) or starts != sorted(set(starts)):
            return Refusal("segments", f"segment starts {starts[:8]} not increasing within {n} tokens")
        spans = span_problem(traj, self.cfg)
        if spans is not None:
            return Refusal("turn_spans", spans)
        return None
