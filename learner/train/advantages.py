"""Group-relative advantages, per token, and the filters that choose which groups are trained.

A group is the `group_size` episodes played from one environment seed; every estimator here
scores an episode against the other members of its group, so no value network is needed.
`compute_advantages(groups, cfg)` returns, for every trajectory, one advantage per token of
`token_ids`: 0.0 wherever `loss_mask` is 0 (prompt and observation tokens never carry advantage).
docs/algorithms.md has the formulas and the papers.

Estimators (`cfg.advantage`), each mapping a list of rewards to one advantage per reward:

- grpo: `(r - mean) / (std + eps)`. The std is the POPULATION std (ddof=0); that reproduces
  RAGEN's worked example (rewards 3.0 and 2.0 give +1 and -1). verl and TRL use the sample std,
  which only rescales every advantage of a group by sqrt((n-1)/n).
- drgrpo: `r - mean` (Dr.GRPO drops the std, which over-weights groups of low reward spread).
- rloo: `r_i - mean(r_j, j != i)` = `n/(n-1) * (r_i - mean)`; they sum to zero in a group.
- ngrpo: GRPO over the group plus one virtual member of reward `cfg.ngrpo_max_reward`, which
  only enters the mean and std (it gets no output): an all-wrong group still gets negative
  advantages. (The NGRPO paper's numbers use the sample std; ours is again the population std.)
- gigpo: see below.

Reward levels (`cfg.reward_level`, for every estimator but gigpo):

- trajectory: the estimator runs on the episodes' returns (`Trajectory.reward`) and each
  episode's value goes on all its generated tokens (Flow-GRPO, StarPO trajectory level).
- turn: turn t of episode i has the discounted reward-to-go G_t = sum_{j>=t} gamma^(j-t) r_j.
  For each turn index t, the estimator runs over the G_t of the episodes that HAVE a turn t, and
  each result goes on that turn's response tokens [turn_starts[t], turn_ends[t]). An episode that
  ended earlier is left out of turn t's comparison rather than counted as G_t = 0: it made no
  decision there, and a zero would reward the later turns of every long episode just for
  existing. A turn index reached by a single episode therefore gets 0 (ngrpo: the virtual
  member still gives it a value). With one turn per episode this equals the trajectory level.

GiGPO (Feng et al. 2025) ignores `reward_level`: each generated token gets the episode advantage
A_E (GRPO over the returns, undiscounted) plus `cfg.gigpo_step_weight` x the step advantage A_S of
its turn. Step groups are the turns, of all episodes in the group and at any turn index, that
acted on the same anchor state (equal `anchors[t]`); A_S is GRPO over their G_t, so a step
group of one, or of equal returns, gives 0. The paper lets F_norm be the std or 1 and uses the
same one at both levels; we use the std at both (the config's documented rule; verl-agent's
`mode=mean_std_norm`), with the population std and one return per episode for A_E, like grpo
here (verl-agent's code uses the sample std and counts every step row). An empty anchor means
"state unknown" (the env's default), never "same state": each such turn is its own step group.

A group whose values are all equal gets exactly 0 (tested by equality: floating-point noise in
`r - mean` must not become a huge advantage through a tiny std). Everything is pure Python over
small lists: no torch import.

Filters (`cfg.group_filter`) pick the groups that are trained among complete candidates:
zero_std drops groups whose rewards are all equal (DAPO dynamic sampling: they carry no
gradient); starpo_s keeps the share `cfg.starpo_keep` with the highest reward std (StarPO-S).
`filter_pool_size` says how many candidates to take so that about `groups_per_batch` survive.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # only for type hints; keeps this module free of runtime imports
    from millstream.learner.replay import Group
    from millstream.shared.config import LearnerConfig
    from millstream.shared.wire import Trajectory

from millstream.shared.config.learning import filter_pool_size  # one formula: the config checks it too

__all__ = [
    "EPS",
    "span_problem",
    "Estimator",
    "ESTIMATORS",
    "grpo_advantages",
    "drgrpo_advantages",
    "rloo_advantages",
    "ngrpo_advantages",
    "group_advantages",
    "discounted_returns",
    "compute_advantages",
    "filter_groups",
    "has_reward_spread",
    "filter_pool_size",
]

#: Added to the std before dividing (GRPO's and verl's customary 1e-6).
EPS = 1e-6

#: An estimator maps a group's rewards to one advantage per reward, same order.
Estimator = Callable[..., list[float]]


def grpo_advantages(rewards: Sequence[float], *, normalize_std: bool = True, eps: float = EPS) -> list[float]:
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
    denom = _std(rewards) + eps
    return [c / denom for c in centered]


def drgrpo_advantages(rewards: Sequence[float], *, eps: float = EPS) -> list[float]:
    """Dr.GRPO: `r - mean`, no std normalisation (`eps` accepted for a uniform signature)."""
    return grpo_advantages(rewards, normalize_std=False, eps=eps)


def rloo_advantages(rewards: Sequence[float], *, eps: float = EPS) -> list[float]:
    """RLOO: each reward minus the mean of the OTHER rewards; 0 for a group of one."""
    n = len(rewards)
    if n < 2:
        return [0.0] * n
    # r_i - (S - r_i)/(n-1) == n/(n-1) * (r_i - mean): the centred form keeps the exact-zero
    # rule for equal rewards and sums to zero up to rounding.
    return [n / (n - 1) * c for c in drgrpo_advantages(rewards, eps=eps)]


def ngrpo_advantages(rewards: Sequence[float], *, max_reward: float = 1.0, eps: float = EPS) -> list[float]:
    """NGRPO: GRPO with a virtual member of reward `max_reward` in the mean and std only."""
    if not rewards:
        return []
    return grpo_advantages([*rewards, max_reward], eps=eps)[:-1]


ESTIMATORS: dict[str, Estimator] = {
    "grpo": grpo_advantages,
    "drgrpo": drgrpo_advantages,
    "rloo": rloo_advantages,
    "ngrpo": ngrpo_advantages,
}


def group_advantages(
    groups: list[Group], estimator: str = "grpo", **kwargs: float | bool
) -> list[list[float]]:
    """Per-trajectory scalar advantages of the episode returns, in the groups' trajectory order.

    `estimator` names an entry of `ESTIMATORS`; `kwargs` go to it (e.g. `eps=1e-4`).
    """
    fn = _lookup(estimator)
    return [fn([t.reward for t in g.trajectories], **kwargs) for g in groups]


def discounted_returns(rewards: Sequence[float], gamma: float) -> list[float]:
    """Reward-to-go of every turn: G_t = sum_{j>=t} gamma^(j-t) r_j (computed backwards)."""
    out = [0.0] * len(rewards)
    running = 0.0
    for t in range(len(rewards) - 1, -1, -1):
        running = rewards[t] + gamma * running
        out[t] = running
    return out


def compute_advantages(groups: list[Group], cfg: LearnerConfig) -> list[list[list[float]]]:
    """Per-token advantages: [group][trajectory][token], 0.0 wherever `loss_mask` is 0.

    Raises ValueError (naming the episode) on a non-finite reward, or when the turn-level or
    GiGPO estimate needs turn spans the trajectory does not have consistently.
    """
    out: list[list[list[float]]] = []
    for group in groups:
        trajs = group.trajectories
        for traj in trajs:
            _check(
                traj,
                spans=cfg.advantage == "gigpo" or cfg.reward_level == "turn",
                anchors=cfg.advantage == "gigpo",
            )
        if cfg.advantage == "gigpo":
            out.append(_gigpo(trajs, cfg))
        elif cfg.reward_level == "trajectory":
            scalar = _scalar(cfg)([t.reward for t in trajs])
            out.append([_place(t, a, []) for t, a in zip(trajs, scalar)])
        else:
            out.append(_turn_level(trajs, cfg))
    return out


def filter_groups(groups: list[Group], cfg: LearnerConfig) -> tuple[list[Group], list[Group]]:
    """(kept, rejected) by `cfg.group_filter`; both lists keep the candidates' order.

    starpo_s keeps the `max(1, round(len(groups) * starpo_keep))` groups of highest population
    reward std (Python's round: halves go to even), ties going to the earlier group, so the
    oldest experience wins a tie.
    """
    mode = cfg.group_filter
    if mode == "none":
        return list(groups), []
    if mode == "zero_std":
        # Exact equality, the same test that gives an all-equal group zero advantages.
        kept = [g for g in groups if has_reward_spread(g)]
        return kept, [g for g in groups if not has_reward_spread(g)]
    if mode == "starpo_s":
        if not groups:
            return [], []
        k = max(1, round(len(groups) * cfg.starpo_keep))
        stds = [_std([t.reward for t in g.trajectories]) for g in groups]
        # sorted() is stable, so equal stds stay in candidate order: earlier wins.
        top = set(sorted(range(len(groups)), key=lambda i: -stds[i])[:k])
        return (
            [g for i, g in enumerate(groups) if i in top],
            [g for i, g in enumerate(groups) if i not in top],
        )
    raise ValueError(f"unknown group_filter {mode!r}; known: none, zero_std, starpo_s")


# --- internals ------------------------------------------------------------------------------


def _lookup(name: str) -> Estimator:
    try:
        return ESTIMATORS[name]
    except KeyError:
        raise ValueError(f"unknown advantage estimator {name!r}; known: {sorted(ESTIMATORS)}") from None


def _scalar(cfg: LearnerConfig) -> Callable[[Sequence[float]], list[float]]:
    """The configured list estimator, with its config-given parameters bound."""
    if cfg.advantage == "ngrpo":
        return lambda r: ngrpo_advantages(r, max_reward=cfg.ngrpo_max_reward)
    return _lookup(cfg.advantage)


def _std(values: Sequence[float]) -> float:
    """Population std; fsum makes it independent of order, so permuted groups tie exactly."""
    n = len(values)
    if n == 0:
        return 0.0
    mean = math.fsum(values) / n
    return math.sqrt(math.fsum((v - mean) ** 2 for v in values) / n)


def has_reward_spread(group: Group) -> bool:
    """Whether the group's rewards are not all equal (`zero_std` keeps these: the others have
    zero advantages everywhere, and carry no gradient)."""
    rewards = [t.reward for t in group.trajectories]
    return bool(rewards) and max(rewards) != min(rewards)


def span_problem(traj: Trajectory, cfg: LearnerConfig) -> str | None:
    """What `compute_advantages` would refuse in `traj` under `cfg`, in words, or None
    (learner/episodes/validate.py asks on arrival, so a bad trajectory never reaches a batch)."""
    try:
        _check(
            traj,
            spans=cfg.advantage == "gigpo" or cfg.reward_level == "turn",
            anchors=cfg.advantage == "gigpo",
        )
    except ValueError as exc:
        return str(exc)
    return None


def _check(traj: Trajectory, *, spans: bool, anchors: bool) -> None:
    def bad(why: str) -> ValueError:
        return ValueError(f"episode {traj.episode_id!r}: {why}")

    n = len(traj.token_ids)
    if len(traj.loss_mask) != n:
        raise bad(f"loss_mask has {len(traj.loss_mask)} entries for {n} tokens")
    if not all(math.isfinite(r) for r in (traj.reward, *traj.turn_rewards)):
        raise bad(f"non-finite reward {traj.reward!r} / {traj.turn_rewards!r}")
    if not spans:
        return
    turns = len(traj.turn_rewards)
    if not len(traj.turn_starts) == len(traj.turn_ends) == turns:
        raise bad(
            f"{len(traj.turn_starts)} turn starts, {len(traj.turn_ends)} ends and "
            f"{turns} turn rewards: turn-level advantages need one span per turn"
        )
    if anchors and len(traj.anchors) != turns:
        raise bad(f"{len(traj.anchors)} anchors for {turns} turns (GiGPO needs one per turn)")
    prev = 0
    for s, e in zip(traj.turn_starts, traj.turn_ends):
        # Ordered and disjoint: a token must not collect two turns' advantages.
        if not prev <= s <= e <= n:
            raise bad(f"turn span [{s}, {e}) is out of order or outside the {n} tokens")
        prev = e


def _place(traj: Trajectory, base: float, per_turn: Sequence[float]) -> list[float]:
    """`base` on every generated token, plus `per_turn[t]` on the generated tokens of turn t.

    Generated tokens outside every turn span (none, from the envpool) get `base` alone.
    """
    mask = traj.loss_mask
    out = [base if m else 0.0 for m in mask]
    for s, e, extra in zip(traj.turn_starts, traj.turn_ends, per_turn):
        for i in range(s, e):
            if mask[i]:
                out[i] = base + extra
    return out


def _turn_level(trajs: Sequence[Trajectory], cfg: LearnerConfig) -> list[list[float]]:
    fn = _scalar(cfg)
    returns = [discounted_returns(t.turn_rewards, cfg.gamma) for t in trajs]
    per_turn: list[list[float]] = [[0.0] * len(g) for g in returns]
    for t in range(max((len(g) for g in returns), default=0)):
        members = [i for i, g in enumerate(returns) if len(g) > t]  # episodes that reached t
        for i, a in zip(members, fn([returns[i][t] for i in members])):
            per_turn[i][t] = a
    return [_place(traj, 0.0, adv) for traj, adv in zip(trajs, per_turn)]


def _gigpo(trajs: Sequence[Trajectory], cfg: LearnerConfig) -> list[list[float]]:
    episode = grpo_advantages([t.reward for t in trajs])
    returns = [discounted_returns(t.turn_rewards, cfg.gamma) for t in trajs]
    # Anchor-state grouping: (episode, turn) pairs by equal non-empty anchor.
    steps: dict[str, list[tuple[int, int]]] = {}
    for i, traj in enumerate(trajs):
        for t, anchor in enumerate(traj.anchors):
            if anchor:
                steps.setdefault(anchor, []).append((i, t))
    step_adv: list[list[float]] = [[0.0] * len(g) for g in returns]
    for members in steps.values():
        for (i, t), a in zip(members, grpo_advantages([returns[i][t] for i, t in members])):
            step_adv[i][t] = a
    w = cfg.gigpo_step_weight
    return [_place(traj, episode[i], [w * a for a in step_adv[i]]) for i, traj in enumerate(trajs)]
