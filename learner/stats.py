"""What one training step reports: batch statistics, and the one-line progress summary.

Staleness is measured on the tokens actually trained: for every generated token, the learner
version that trains on it minus the policy version that sampled it. Its max is what
`train.max_staleness` bounds.

`NoSignalWatch` counts steps in a row whose every group had equal rewards: GRPO-family
advantages are then zero everywhere, the step changes nothing, and the run is burning compute
(the task is too hard or too easy for the policy, or the reward is broken). After `after` such
steps the progress line says so, and every record carries `warning/no_signal_steps`.

`CollapseWatch` is RAGEN's early warning for the "echo trap": when the reward spread within
groups and the policy's entropy fall together, the policy is converging on one templated
answer and gradients are about to vanish. It compares the mean of the last `window` steps with
the best earlier window and warns (once, until it recovers) when both fell below `ratio` of it.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter

from millstream.learner.replay import Group
from millstream.shared.wire import Trajectory

__all__ = [
    "batch_metrics",
    "domain_metrics",
    "buffer_metrics",
    "progress_line",
    "CollapseWatch",
    "NoSignalWatch",
]


def batch_metrics(batch: list[Group], version: int, step_s: float, elapsed_s: float) -> dict:
    rewards = [t.reward for g in batch for t in g.trajectories]
    lags = [version - v for g in batch for t in g.trajectories for v, m in zip(t.versions, t.loss_mask) if m]
    tokens = len(lags)
    zero_std = sum(1 for g in batch if len({t.reward for t in g.trajectories}) == 1)
    truncated = Counter(str(t.truncated) for g in batch for t in g.trajectories if t.truncated)
    return {
        **{f"batch/truncated/{why}": n for why, n in truncated.items()},
        "reward/mean": statistics.fmean(rewards),
        "reward/std": statistics.pstdev(rewards),
        "reward/min": min(rewards),
        "reward/max": max(rewards),
        "reward/frac_zero_std_groups": zero_std / len(batch),
        "staleness/min": min(lags, default=0),
        "staleness/mean": statistics.fmean(lags) if lags else 0.0,
        "staleness/max": max(lags, default=0),
        "batch/episodes": len(rewards),
        "batch/groups": len(batch),
        "batch/generated_tokens": tokens,
        "batch/turns_mean": statistics.fmean(t.num_turns for g in batch for t in g.trajectories),
        "perf/step_s": step_s,
        "perf/tokens_per_s": tokens / step_s if step_s > 0 else 0.0,
        "perf/episodes_per_s": len(rewards) / step_s if step_s > 0 else 0.0,
        "perf/elapsed_s": elapsed_s,
        **domain_metrics([t for g in batch for t in g.trajectories]),
    }


def _generated_tokens(t: Trajectory) -> int:
    """Tokens the model generated in the episode (trained or not)."""
    return sum(end - start for start, end in zip(t.turn_starts, t.turn_ends))


def _episode_stats(trajectories: list[Trajectory], prefix: str) -> dict[str, float]:
    lengths = sorted(_generated_tokens(t) for t in trajectories)
    n = len(trajectories)
    out = {
        f"{prefix}invalid_action_rate": sum(t.invalid_actions for t in trajectories)
        / max(1, sum(t.num_turns for t in trajectories)),
        f"{prefix}truncated_rate": sum(1 for t in trajectories if t.truncated) / n,
        f"{prefix}turns_mean": statistics.fmean(t.num_turns for t in trajectories),
        f"{prefix}response_len/mean": statistics.fmean(lengths),
        f"{prefix}response_len/p95": float(lengths[min(n - 1, math.ceil(0.95 * n) - 1)]),
        f"{prefix}response_len/max": float(lengths[-1]),
        # Contexts the learner trains per episode (an agent's calls that did not extend the
        # context start new ones) and the tokens it runs through them: the cost of an episode.
        f"{prefix}segments_mean": statistics.fmean(1 + len(t.segment_starts) for t in trajectories),
        f"{prefix}sequence_tokens_mean": statistics.fmean(len(t.token_ids) for t in trajectories),
    }
    reported = [t.success for t in trajectories if t.success is not None]
    if reported:  # only where the environment says what success is
        out[f"{prefix}success_rate"] = sum(reported) / len(reported)
    return out


def domain_metrics(trajectories: list[Trajectory]) -> dict[str, float]:
    """What the episodes did, beyond reward: `episode/...`, and `env/<name>/...` when envs mix.

    Rates are per episode except invalid_action_rate (invalid turns / turns); response_len counts
    an episode's generated tokens over all its turns (p95 by nearest rank).
    """
    if not trajectories:
        return {}
    out = _episode_stats(trajectories, "episode/")
    envs = sorted({t.env for t in trajectories})
    if len(envs) > 1:
        for env in envs:
            mine = [t for t in trajectories if t.env == env]
            out.update(_episode_stats(mine, f"env/{env}/"))
            out[f"env/{env}/reward_mean"] = statistics.fmean(t.reward for t in mine)
            out[f"env/{env}/episodes"] = len(mine)
    return out


def _sync(record: dict) -> str:
    if "sync/total_s" not in record:
        return "sync waiting for a replica"  # learner/sync/fleet.py: pushed once one is back
    return f"sync {record['sync/total_s']:.2f}s"


def progress_line(
    record: dict, steps: int, no_signal_after: int = 3, steps_per_min: float | None = None
) -> str:
    """The step's line on standard output; with `steps_per_min` (the recent pace) it ends with
    the pace and the time left at that pace."""
    dropped = sum(v for k, v in record.items() if k.startswith("episodes/dropped/"))
    failed = sum(v for k, v in record.items() if k.startswith("episodes/failed/"))
    line = (
        f"step {record['step']:>4}/{steps} | reward {record['reward/mean']:.3f} "
        f"± {record['reward/std']:.3f} | staleness {record['staleness/min']}/"
        f"{record['staleness/mean']:.2f}/{record['staleness/max']} | "
        f"{record['perf/tokens_per_s']:.0f} tok/s | dropped {dropped} failed {failed} | "
        f"{_sync(record)} | {record['perf/elapsed_s']:.0f}s"
    )
    if steps_per_min:
        left_s = (steps - record["step"]) / steps_per_min * 60
        line += f" | {steps_per_min:.1f} steps/min, ETA {_clock(left_s)}"
    replicas, up = record.get("fleet/replicas", 1), record.get("fleet/up", 1)
    if replicas > 1 or up < replicas:
        line += f" | replicas {up:.0f}/{replicas:.0f}"
    quiet = record.get("warning/no_signal_steps", 0)
    if quiet >= no_signal_after:
        line += f" | NO SIGNAL: equal rewards in every group for {quiet} steps"
    return line


def _clock(seconds: float) -> str:
    """12s, 4m05s, 2h03m."""
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


class NoSignalWatch:
    def __init__(self, after: int = 3) -> None:
        self.after = after
        self.streak = 0

    def update(self, frac_zero_std_groups: float) -> int:
        """Record one step's share of groups with equal rewards; returns the current streak."""
        self.streak = self.streak + 1 if frac_zero_std_groups >= 1.0 else 0
        return self.streak


class CollapseWatch:
    def __init__(self, window: int = 5, ratio: float = 0.5) -> None:
        self.window, self.ratio = window, ratio
        self.stds: list[float] = []
        self.entropies: list[float] = []
        self.warned = False

    def update(self, reward_std: float, entropy: float | None) -> dict | None:
        """Record one step; returns the warning's details the step it first fires, else None."""
        if entropy is None:
            return None
        self.stds.append(reward_std)
        self.entropies.append(entropy)
        w = self.window
        if len(self.stds) < 2 * w:
            return None
        recent_std = statistics.fmean(self.stds[-w:])
        recent_ent = statistics.fmean(self.entropies[-w:])
        best_std = max(statistics.fmean(self.stds[i : i + w]) for i in range(len(self.stds) - 2 * w + 1))
        best_ent = max(
            statistics.fmean(self.entropies[i : i + w]) for i in range(len(self.entropies) - 2 * w + 1)
        )
        collapsing = recent_std < self.ratio * best_std and recent_ent < self.ratio * best_ent
        if collapsing and not self.warned:
            self.warned = True
            return {
                "reward_std": recent_std,
                "reward_std_peak": best_std,
                "entropy": recent_ent,
                "entropy_peak": best_ent,
            }
        if not collapsing:
            self.warned = False
        return None


def buffer_metrics(stats: dict) -> dict:
    """The replay buffer's counters (`ReplayBuffer.statistics()`) as namespaced metrics."""
    out = {
        "episodes/received": stats["received"],
        "episodes/trained": stats["trained"],
        "episodes/buffered": stats["buffered"],
        "groups/dropped": stats["dropped_groups"],
    }
    out.update({f"episodes/dropped/{k}": v for k, v in stats["dropped"].items()})
    out.update({f"episodes/failed/{k}": v for k, v in stats["failed"].items()})
    out.update({f"episodes/refused/{k}": v for k, v in stats["refused"].items()})
    return out
