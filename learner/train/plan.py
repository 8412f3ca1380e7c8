"""One optimizer step's bookkeeping: how its samples are cut and counted, and its metrics.

`plan_step` turns a rank's samples into padded micro-batches and counts, over all ranks, what
normalises the step's loss; `accumulate` adds one micro-batch's statistics to the step's running
sums and maxima (on the device: no host sync per micro-batch); `step_metrics` reduces them over
the ranks into the plain floats `Trainer.train_step` returns (learner/train/trainer.py).

Design choices:

- Loss normalisation is exact across micro-batches: every token's weight in the loss
  (`aggregation_weights`, learner/train/loss.py) is computed from step totals (loss tokens,
  sequences, all ranks) and from its own sequence, so the micro-batch gradients add up to the
  gradient of one big batch whatever the micro-batch size, for every `loss_agg`.
- Sequences are sorted by length before they are cut into micro-batches: less padding, same sum.
- ZeRO-2/3 reduce gradients inside backward, so every rank runs as many micro-batches
  (`n_chunks`, the most any rank has); a rank with fewer repeats its last one at weight 0.
- Collectives come in through `all_reduce` (the trainer's: a no-op with one rank), so this
  module holds no engine.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from millstream.learner.train.batching import TrainSample, check_samples, pad_batch
from millstream.shared.config import LearnerConfig

__all__ = ["AllReduce", "StepPlan", "plan_step", "accumulate", "step_metrics"]

#: `all_reduce(values, "sum" | "max")`: the values reduced over every rank, as floats.
AllReduce = Callable[[list[float] | torch.Tensor, str], list[float]]


@dataclass
class StepPlan:
    """One step's micro-batches and the counts over all ranks that normalise its loss."""

    batches: list[dict[str, torch.Tensor]]
    #: Micro-batches every rank runs (the most any rank has).
    n_chunks: int
    total_tokens: int
    total_seqs: int
    all_samples: int
    decoupled: bool
    world: int
    generation_budget: int


def plan_step(
    samples: list[TrainSample],
    cfg: LearnerConfig,
    generation_budget: int,
    *,
    micro_batch_size: int,
    device: torch.device,
    world: int,
    has_reference: bool,
    all_reduce: AllReduce,
) -> StepPlan:
    """Check the samples, count them over all ranks, cut them into micro-batches."""
    local_tokens, local_seqs = check_samples(samples, cfg, generation_budget)
    if cfg.kl_coef > 0 and not has_reference:
        raise ValueError(
            "kl_coef > 0 needs the reference policy: build the Trainer with a "
            "learner config whose kl_coef > 0"
        )
    order = sorted(range(len(samples)), key=lambda i: len(samples[i].token_ids), reverse=True)
    mbs = micro_batch_size
    chunks = [order[lo : lo + mbs] for lo in range(0, len(order), mbs)]
    # ZeRO-2/3 reduce gradients inside backward, so all ranks must run as many micro-batches;
    # a rank with fewer repeats its last one at weight 0.
    total_tokens, total_seqs, all_samples = (
        int(v) for v in all_reduce([local_tokens, local_seqs, len(samples)], "sum")
    )
    n_chunks = int(all_reduce([len(chunks)], "max")[0])
    if total_tokens == 0:
        # Every aggregation is undefined over zero tokens; the caller should filter these.
        raise ValueError("train_step got no loss-carrying tokens (every loss_mask is 0)")
    batches = [pad_batch([samples[i] for i in chunk], device) for chunk in chunks]
    return StepPlan(
        batches,
        n_chunks,
        total_tokens,
        total_seqs,
        all_samples,
        cfg.staleness_policy == "decoupled",
        world,
        generation_budget,
    )


def accumulate(
    stats: dict[str, torch.Tensor], sums: dict[str, torch.Tensor], maxes: dict[str, torch.Tensor]
) -> None:
    """Add one micro-batch's statistics to the step's: `*_max` keys to `maxes`, the rest summed."""
    for key, value in stats.items():
        value = value.detach().double()
        if key.endswith("_max"):
            maxes[key] = torch.maximum(maxes[key], value) if key in maxes else value
        else:
            sums[key] = sums[key] + value if key in sums else value


def step_metrics(
    plan: StepPlan,
    sums: dict[str, torch.Tensor],
    maxes: dict[str, torch.Tensor],
    *,
    grad_norm: float,
    elapsed_s: float,
    all_reduce: AllReduce,
) -> dict[str, float]:
    """The step's metrics over all ranks (see `Trainer.train_step`)."""
    world = plan.world
    s = dict(zip(sums, all_reduce(torch.stack(list(sums.values())), "sum"), strict=True))
    m = dict(zip(maxes, all_reduce(torch.stack(list(maxes.values())), "max"), strict=True))
    n = float(plan.total_tokens)
    # Each rank's loss carries the factor `world` (the trainer scales it so): the global loss
    # is their sum / world.
    metrics = {"loss": s["loss"] / world, "pg_loss": s["pg_loss"] / world}
    if "kl_sum" in s:
        metrics["kl"] = s["kl_sum"] / n
    metrics.update(
        {
            "entropy": s["entropy_sum"] / n,
            "clip_frac": s["clipped_tokens"] / n,
            "approx_kl": s["approx_kl_sum"] / n,
            "ratio_mean": s["ratio_sum"] / n,
            "ratio_max": m["ratio_max"],
        }
    )
    if plan.decoupled:
        metrics.update(
            {
                "is_weight_mean": s["is_weight_sum"] / n,
                "is_weight_max": m["is_weight_max"],
                "is_capped_frac": s["is_capped_tokens"] / n,
            }
        )
    metrics.update(
        {
            "grad_norm": grad_norm,
            "tokens": n,
            "sequences": float(plan.all_samples),
            "step_time_s": elapsed_s,
        }
    )
    return metrics
