"""What one training step reports: batch statistics, and the one-line progress summary.

Staleness is measured on the tokens actually trained: for every generated token, the learner
version that trains on it minus the policy version that sampled it. Its max is what
`train.max_staleness` bounds.
"""

from __future__ import annotations

import statistics

from .replay import Group

__all__ = ["batch_metrics", "progress_line"]


def batch_metrics(batch: list[Group], version: int, step_s: float, elapsed_s: float) -> dict:
    rewards = [t.reward for g in batch for t in g.trajectories]
    lags = [version - v for g in batch for t in g.trajectories
            for v, m in zip(t.versions, t.loss_mask) if m]
    tokens = len(lags)
    zero_std = sum(1 for g in batch if len({t.reward for t in g.trajectories}) == 1)
    return {
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
    }


def progress_line(record: dict, steps: int) -> str:
    dropped = sum(v for k, v in record.items() if k.startswith("episodes/dropped/"))
    failed = sum(v for k, v in record.items() if k.startswith("episodes/failed/"))
    return (f"step {record['step']:>4}/{steps} | reward {record['reward/mean']:.3f} "
            f"± {record['reward/std']:.3f} | staleness {record['staleness/min']}/"
            f"{record['staleness/mean']:.2f}/{record['staleness/max']} | "
            f"{record['perf/tokens_per_s']:.0f} tok/s | dropped {dropped} failed {failed} | "
            f"sync {record['sync/total_s']:.2f}s | {record['perf/elapsed_s']:.0f}s")
