"""Per-token log-probabilities and the PPO clip loss over them.

`sequence_logprobs` turns a causal LM's logits into the log-probability and the entropy of each
token given the tokens before it. Position t is predicted by the logits at t-1, so position 0
(never predicted) gets 0 for both. It computes in float32 whatever the model's dtype (bf16
log-softmax loses the small differences PPO ratios are made of). One log_softmax serves both the
gather and the entropy, so the float32 [B, T-1, V] tensors are computed once, never per use.

`ppo_clip_loss` is the clipped surrogate with separate lower and upper clip ranges (DAPO's
clip-higher). The loss is a token mean over the WHOLE batch: each micro-batch divides its sum by
`normalizer`, the batch's total number of loss tokens, so micro-batch losses (and gradients) add up
to the full-batch loss however the batch is split. Tokens outside the mask are neutralised with
`torch.where` before any arithmetic, so garbage there (NaN/inf behaviour logprobs on prompt or
padding tokens) cannot reach the loss or its gradients: `0 * NaN` would be NaN, `where` is not.

Statistics are detached SUMS over loss tokens (plus a max), never means, for the same reason as the
normalizer: the trainer adds them up across micro-batches (max: takes the max) and divides by the
total `tokens` once at the end.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["sequence_logprobs", "ppo_clip_loss"]


def sequence_logprobs(logits: Tensor, token_ids: Tensor) -> tuple[Tensor, Tensor]:
    """Log-prob and predictive entropy of each token: ([B, T], [B, T]) float32, 0 at t = 0.

    `logits` [B, T, V] come from a causal LM run over `token_ids` [B, T]; `logp[:, t]` is
    log p(token_ids[:, t] | token_ids[:, :t]) and `entropy[:, t]` the entropy of that distribution.
    """
    if logits.dim() != 3 or token_ids.shape != logits.shape[:2]:
        raise ValueError(
            f"expected logits [B, T, V] and token_ids [B, T], got {tuple(logits.shape)} and "
            f"{tuple(token_ids.shape)}"
        )
    # Logits at t-1 predict token t; the last position predicts beyond the sequence: unused.
    logsm = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    target = token_ids[:, 1:].long().unsqueeze(-1)
    logp = logsm.gather(-1, target).squeeze(-1)
    # -sum p log p from the same log_softmax. Clamping keeps -inf logits (masked vocabulary)
    # from making 0 * -inf = NaN; the clamp is inactive on every finite value.
    entropy = -(logsm.exp() * logsm.clamp(min=torch.finfo(logsm.dtype).min)).sum(-1)
    zero = logp.new_zeros(logp.shape[0], 1)
    return torch.cat([zero, logp], dim=1), torch.cat([zero, entropy], dim=1)


def ppo_clip_loss(
    logp: Tensor,
    behav_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float,
    clip_high: float,
    normalizer: float,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate, summed over loss tokens and divided by `normalizer`.

    All tensors are [B, T]: current logprobs (with grad), behaviour logprobs from the actor,
    advantages broadcast per token, and the loss mask (nonzero on model-generated tokens).
    Per token: `-min(ratio * A, clamp(ratio, 1 - clip_low, 1 + clip_high) * A)`,
    `ratio = exp(logp - behav_logp)`.

    Returns (loss, stats); stats are detached and accumulate across micro-batches by adding
    (ratio_max: by max):
      tokens          number of loss tokens
      clipped_tokens  loss tokens whose gradient the clip removed (A > 0 and ratio > 1 + clip_high,
                      or A < 0 and ratio < 1 - clip_low)
      ratio_sum       sum of the importance ratio
      ratio_max       largest importance ratio (0 when there are no loss tokens)
      approx_kl_sum   sum of the k3 estimate of KL(behaviour || current)
    The k3 estimator is `(r - 1) - log r` with `r = p_current / p_behav = ratio`: tokens were
    sampled from the behaviour policy, and for samples x ~ q, k3 with r = p(x)/q(x) is an unbiased,
    always non-negative estimate of KL(q || p). (With r = p_behav / p_current it would estimate
    KL(current || behaviour) only for samples from the current policy, which we do not have.)
    """
    if normalizer <= 0:
        raise ValueError(f"normalizer must be > 0 (loss tokens in the batch), got {normalizer}")
    if not (logp.shape == behav_logp.shape == advantages.shape == mask.shape):
        raise ValueError(
            "logp, behav_logp, advantages and mask must share one [B, T] shape, got "
            f"{[tuple(t.shape) for t in (logp, behav_logp, advantages, mask)]}"
        )
    on = mask > 0
    zero = torch.zeros((), dtype=torch.float32, device=logp.device)
    # Neutralise non-loss tokens first: log ratio 0 (ratio 1) and advantage 0 there.
    log_ratio = torch.where(on, logp.float() - behav_logp.float(), zero)
    adv = torch.where(on, advantages.float(), zero)
    ratio = torch.exp(log_ratio)
    clipped_ratio = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    # Zero off the mask by construction (advantage 0 there), so a plain sum is the masked sum.
    per_token = -torch.minimum(ratio * adv, clipped_ratio * adv)
    loss = per_token.sum() / normalizer

    with torch.no_grad():
        r = ratio.detach()
        lr = log_ratio.detach()
        clipped = on & (((adv > 0) & (r > 1.0 + clip_high)) | ((adv < 0) & (r < 1.0 - clip_low)))
        stats = {
            "tokens": on.sum().float(),
            "clipped_tokens": clipped.sum().float(),
            "ratio_sum": torch.where(on, r, zero).sum(),
            # ratio > 0 everywhere, so 0 off the mask never wins the max (and is the empty answer).
            "ratio_max": torch.where(on, r, zero).max() if r.numel() else zero.clone(),
            "approx_kl_sum": torch.where(on, (r - 1.0) - lr, zero).sum(),
        }
    return loss, stats
