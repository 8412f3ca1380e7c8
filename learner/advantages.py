"""Group-relative advantage estimators: one scalar advantage per trajectory of a group.

GRPO scores each trajectory against the other members of its group (same environment seed):
`(r - mean) / (std + eps)`. The std is the POPULATION std (ddof=0), which reproduces RAGEN's
worked example: rewards 3.0 and 2.0 give advantages +1 and -1. Dr.GRPO drops the std division
(`r - mean`), which removes the bias towards groups with low reward spread.

A group whose rewards are all equal carries no learning signal and gets exactly zero advantages
(tested by equality, so floating-point noise in `r - mean` cannot turn into a huge advantage
through the tiny std).

Estimators are pure Python over lists of floats (groups are small; no torch import needed) and are
looked up by name in `ESTIMATORS`, so more estimators (RLOO, NGRPO, ...) can be added without
touching the trainer. The trainer broadcasts each trajectory's scalar over its loss tokens.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # only for the type hint; keeps this module free of protocol imports at runtime
    from learner.replay import Group

__all__ = [
    "Estimator",
    "ESTIMATORS",
    "grpo_advantages",
    "drgrpo_advantages",
    "group_advantages",
]

#: An estimator maps a group's rewards to one advantage per reward, same order.
Estimator = Callable[..., list[float]]


def grpo_advantages(
    rewards: Sequence[float], *, normalize_std: bool = True, eps: float = 1e-6
) -> list[float]:
    """GRPO advantages `(r - mean) / (std + eps)` (population std); `r - mean` without std."""
    n = len(rewards)
    if n == 0:
        return []
    if max(rewards) == min(rewards):
        return [0.0] * n
    mean = math.fsum(rewards) / n  # fsum: correctly rounded, independent of member order
    centered = [r - mean for r in rewards]
    if not normalize_std:
        return centered
    std = math.sqrt(math.fsum(c * c for c in centered) / n)
    return [c / (std + eps) for c in centered]


def drgrpo_advantages(rewards: Sequence[float], *, eps: float = 1e-6) -> list[float]:
    """Dr.GRPO: `r - mean`, no std normalisation (`eps` accepted for a uniform signature)."""
    return grpo_advantages(rewards, normalize_std=False, eps=eps)


ESTIMATORS: dict[str, Estimator] = {
    "grpo": grpo_advantages,
    "drgrpo": drgrpo_advantages,
}


def group_advantages(
    groups: list[Group], estimator: str = "grpo", **kwargs: float | bool
) -> list[list[float]]:
    """Per-trajectory scalar advantages for each group, in the groups' trajectory order.

    `estimator` names an entry of `ESTIMATORS`; `kwargs` go to it (e.g. `eps=1e-4`).
    """
    try:
        fn = ESTIMATORS[estimator]
    except KeyError:
        raise ValueError(
            f"unknown advantage estimator {estimator!r}; known: {sorted(ESTIMATORS)}"
        ) from None
    return [fn([t.reward for t in g.trajectories], **kwargs) for g in groups]
