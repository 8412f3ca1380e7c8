"""Training samples: what one sequence to train carries, its checks, and micro-batch padding.

`TrainSample` is the learner's unit of training: one context's token ids, which of them carry
loss, the behaviour policy's logprob of each and its advantage. `check_samples` refuses what no
loss can be computed from (lists of different lengths, loss on position 0, a sequence longer
than Dr.GRPO's constant normaliser allows) and counts what the loss is normalised by;
`pad_batch` right-pads a micro-batch into tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from millstream.shared.config import LearnerConfig
from millstream.shared.wire import Trajectory

__all__ = ["TrainSample", "PAD_ID", "train_samples", "check_samples", "pad_batch"]

#: Right-padding token id; padded positions carry attention_mask 0 and loss mask 0.
PAD_ID = 0


@dataclass
class TrainSample:
    """One sequence to train on; all four lists have the same length."""

    token_ids: list[int]
    loss_mask: list[int]  # 1 where the model generated the token and it carries loss
    behav_logprobs: list[float]  # behaviour-policy logprob per token (0.0 where mask is 0)
    advantages: list[float]  # per-token advantage (already broadcast)


def check_samples(samples: list[TrainSample], cfg: LearnerConfig, generation_budget: int) -> tuple[int, int]:
    """Validate the samples; return their loss tokens and sequences with loss tokens."""
    if not samples:
        raise ValueError("train_step needs at least one sample (on every rank)")
    if not isinstance(generation_budget, int) or generation_budget < 1:
        raise ValueError(f"generation_budget must be an int >= 1, got {generation_budget!r}")
    tokens = sequences = 0
    for i, s in enumerate(samples):
        t = len(s.token_ids)
        if not (len(s.loss_mask) == len(s.behav_logprobs) == len(s.advantages) == t):
            raise ValueError(
                f"sample {i}: token_ids, loss_mask, behav_logprobs and advantages must have the same length"
            )
        if t and s.loss_mask[0]:
            # Position 0 has no context, hence no logprob: it can never carry loss.
            raise ValueError(f"sample {i}: loss_mask[0] must be 0")
        n = sum(1 for m in s.loss_mask if m)
        if cfg.loss_agg == "seq_sum_norm" and n > generation_budget:
            # Dr.GRPO's constant normaliser assumes no sequence exceeds the budget; more
            # means the caller's budget is wrong (e.g. max_tokens without max_turns).
            raise ValueError(f"sample {i}: {n} loss tokens exceed generation_budget {generation_budget}")
        tokens += n
        sequences += n > 0
    return tokens, sequences


def pad_batch(samples: list[TrainSample], device: torch.device | str) -> dict[str, torch.Tensor]:
    """Right-pad a micro-batch into tensors on `device`: ids, attn, mask, behav, adv ([B, T])."""
    width = max(len(s.token_ids) for s in samples)
    out = {
        "ids": torch.full((len(samples), width), PAD_ID, dtype=torch.long),
        "attn": torch.zeros((len(samples), width), dtype=torch.long),
    }
    out.update({k: torch.zeros((len(samples), width)) for k in ("mask", "behav", "adv")})
    for i, s in enumerate(samples):
        t = len(s.token_ids)
        out["ids"][i, :t] = torch.tensor(s.token_ids, dtype=torch.long)
        out["attn"][i, :t] = 1
        out["mask"][i, :t] = torch.tensor(s.loss_mask, dtype=torch.float32)
        out["behav"][i, :t] = torch.tensor(s.behav_logprobs, dtype=torch.float32)
        out["adv"][i, :t] = torch.tensor(s.advantages, dtype=torch.float32)
    return {k: v.to(device) for k, v in out.items()}


def train_samples(traj: Trajectory, advantages: list[float]) -> list[TrainSample]:
    """The sequences one trajectory trains: one per context it used (Delethink chunks are
    separate contexts, `segment_starts`), skipping a context with no trained token."""
    bounds = [0, *traj.segment_starts, len(traj.token_ids)]
    return [
        TrainSample(traj.token_ids[a:b], traj.loss_mask[a:b], traj.logprobs[a:b], advantages[a:b])
        for a, b in zip(bounds, bounds[1:])
        if any(traj.loss_mask[a:b])
    ]
