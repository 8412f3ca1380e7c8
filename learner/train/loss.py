"""Per-token log-probabilities and the RL loss over them: PPO clip (plain or decoupled), KL to a
reference policy, entropy bonus, and the ways of aggregating per-token losses into one number.

Pure functions of tensors; `learner/train/trainer.py` feeds them micro-batch by micro-batch.

`sequence_logprobs` turns a causal LM's logits into the log-probability and the entropy of each
token given the tokens before it. Position t is predicted by the logits at t-1, so position 0
(never predicted) gets 0 for both. It computes in float32 whatever the model's dtype (bf16
log-softmax loses the small differences PPO ratios are made of). One log_softmax serves both the
gather and the entropy, so the float32 [B, T-1, V] tensors are computed once, never per use.

Aggregation. Every loss here is `sum over loss tokens of c[i, t] * l[i, t]`, with per-token
weights `c` from `aggregation_weights` (zero off the mask):

    token_mean    c = 1 / N                  N: loss tokens of the whole step (DAPO token-level)
    seq_mean      c = 1 / (S * L_i)          L_i: loss tokens of sequence i; S: sequences
    seq_sum_norm  c = 1 / (S * G)            G: generation budget per sequence (Dr.GRPO)

N and S are totals over the whole optimizer step (every micro-batch, every rank), and L_i is a
property of one sequence, which never straddles micro-batches; so each c is exact however the step
is cut into micro-batches, and the micro-batch losses (and gradients) add up to the full-batch ones.
S counts the sequences that carry at least one loss token (a sequence without any has no token
mean; it contributes nothing under any aggregation).

Masking. Tokens outside the mask are neutralised with `torch.where` before any arithmetic, so
garbage there (NaN/inf behaviour logprobs or advantages on prompt or padding tokens) cannot reach
the loss or its gradients: `0 * NaN` would be NaN, `where` is not.

Statistics are detached SUMS over loss tokens (plus maxima), never means, for the same reason as the
normalizers: the trainer adds them up across micro-batches and ranks (keys ending in `_max`: takes
the max) and divides by the total `tokens` once at the end. `pg_loss` is the one exception: it is
already weighted by `c`, so its sum over micro-batches is the step's policy loss.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

__all__ = [
    "sequence_logprobs",
    "gather_logprobs",
    "aggregation_weights",
    "kl_penalty",
    "ppo_clip_loss",
    "rl_loss",
]

LossAgg = Literal["token_mean", "seq_mean", "seq_sum_norm"]
KLEstimator = Literal["k1", "k3"]


def _check_logits(logits: Tensor, token_ids: Tensor) -> None:
    if logits.dim() != 3 or token_ids.shape != logits.shape[:2]:
        raise ValueError(
            f"expected logits [B, T, V] and token_ids [B, T], got {tuple(logits.shape)} and "
            f"{tuple(token_ids.shape)}"
        )


def _shifted_log_softmax(logits: Tensor, token_ids: Tensor, temperature: float) -> tuple[Tensor, Tensor]:
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    # Logits at t-1 predict token t; the last position predicts beyond the sequence: unused.
    shifted = logits[:, :-1].float()
    if temperature != 1.0:  # not in place: float32 logits are the model's own, in the graph
        shifted = shifted / temperature
    logsm = torch.log_softmax(shifted, dim=-1)
    logp = logsm.gather(-1, token_ids[:, 1:].long().unsqueeze(-1)).squeeze(-1)
    return logsm, logp


def _pad_first(x: Tensor) -> Tensor:
    return torch.cat([x.new_zeros(x.shape[0], 1), x], dim=1)


def sequence_logprobs(
    logits: Tensor, token_ids: Tensor, *, temperature: float = 1.0, entropy_grad: bool = True
) -> tuple[Tensor, Tensor]:
    """Log-prob and predictive entropy of each token: ([B, T], [B, T]) float32, 0 at t = 0.

    `logits` [B, T, V] come from a causal LM run over `token_ids` [B, T]; `logp[:, t]` is
    log p(token_ids[:, t] | token_ids[:, :t]) and `entropy[:, t]` the entropy of that distribution.
    p is the distribution the tokens were sampled from: softmax(logits / `temperature`), the
    actor's sampling temperature (whose logprobs vLLM reports after it, actor/engine.py).
    With `entropy_grad=False` the entropy is computed without autograd (a statistic only): its
    graph would otherwise keep two more float32 [B, T-1, V] tensors alive until backward.
    """
    _check_logits(logits, token_ids)
    logsm, logp = _shifted_log_softmax(logits, token_ids, temperature)
    with torch.enable_grad() if entropy_grad else torch.no_grad():
        # -sum p log p from the same log_softmax. Clamping keeps -inf logits (masked vocabulary)
        # from making 0 * -inf = NaN; the clamp is inactive on every finite value.
        entropy = -(logsm.exp() * logsm.clamp(min=torch.finfo(logsm.dtype).min)).sum(-1)
    return _pad_first(logp), _pad_first(entropy)


def gather_logprobs(logits: Tensor, token_ids: Tensor, *, temperature: float = 1.0) -> Tensor:
    """Only the log-prob part of `sequence_logprobs` ([B, T] float32, 0 at t = 0): for the
    no-grad proximal and reference passes, which need no entropy."""
    _check_logits(logits, token_ids)
    return _pad_first(_shifted_log_softmax(logits, token_ids, temperature)[1])


def aggregation_weights(
    mask: Tensor,
    loss_agg: LossAgg,
    *,
    tokens: float,
    sequences: float,
    generation_budget: float | None = None,
) -> Tensor:
    """Per-token weights `c` [B, T] float32 (see the module docstring); 0 off the mask.

    `tokens` and `sequences` are the step's totals of loss tokens and of sequences with at least
    one loss token, over all micro-batches and ranks, not this micro-batch's. `generation_budget`
    (most generated tokens one sequence can have) is needed by `seq_sum_norm` only.
    """
    on = mask > 0
    if loss_agg == "token_mean":
        if tokens <= 0:
            raise ValueError(f"token_mean needs tokens > 0, got {tokens}")
        denom = torch.as_tensor(float(tokens))
    elif loss_agg == "seq_mean":
        if sequences <= 0:
            raise ValueError(f"seq_mean needs sequences > 0, got {sequences}")
        # Rows without loss tokens have no token there to weigh; clamp only avoids 0/0.
        denom = on.sum(dim=1, keepdim=True).clamp(min=1).float() * float(sequences)
    elif loss_agg == "seq_sum_norm":
        if sequences <= 0 or not generation_budget or generation_budget <= 0:
            raise ValueError(
                "seq_sum_norm needs sequences > 0 and generation_budget > 0, got "
                f"{sequences} and {generation_budget}"
            )
        denom = torch.as_tensor(float(sequences) * float(generation_budget))
    else:
        raise ValueError(f"unknown loss_agg {loss_agg!r}")
    return torch.where(on, 1.0 / denom.to(mask.device), torch.zeros((), device=mask.device))


def kl_penalty(logp: Tensor, ref_logp: Tensor, mask: Tensor, estimator: KLEstimator) -> Tensor:
    """Per-token estimate [B, T] of KL(current || reference) from the sampled tokens (0 off mask).

    With `d = ref_logp - logp` (log of r = p_ref / p_current), Schulman's approximators are
    `k1 = -d = logp - ref_logp` (unbiased for samples of the current policy, but any sign per token)
    and `k3 = (exp(d) - 1) - d` (unbiased too, and >= 0 per token: lower variance).

    As a LOSS term (what `rl_loss` does), on samples from the current policy: the gradient of k1
    is `grad logp`, whose expectation is 0 (it penalises nothing on average; k1 belongs in the
    reward to act as a penalty); the gradient of k3 is `(1 - p_ref / p) grad logp`, whose
    expectation is the gradient of the forward KL(reference || current): it pulls toward the
    reference. Hence the default k3.
    """
    if estimator not in ("k1", "k3"):
        raise ValueError(f"unknown kl estimator {estimator!r}")
    on = mask > 0
    zero = torch.zeros((), dtype=torch.float32, device=logp.device)
    d = torch.where(on, ref_logp.float() - logp.float(), zero)
    kl = -d if estimator == "k1" else torch.expm1(d) - d
    return torch.where(on, kl, zero)


def ppo_clip_loss(
    logp: Tensor,
    behav_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float,
    clip_high: float,
    weights: Tensor | None = None,
    normalizer: float | None = None,
    prox_logp: Tensor | None = None,
    is_cap: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate, aggregated as `sum(weights * per_token)`.

    All tensors are [B, T]: current logprobs (with grad), behaviour logprobs from the actor,
    advantages broadcast per token, and the loss mask (nonzero on model-generated tokens).
    Aggregation: either `weights` (from `aggregation_weights`) or `normalizer` (token mean with
    that many tokens: weights = mask / normalizer), not both.

    Plain PPO (`prox_logp` None), per token, with DAPO's separate clip ranges:
        r = exp(logp - behav_logp),  l = -min(r * A, clip(r, 1 - clip_low, 1 + clip_high) * A)
    Decoupled PPO (AReaL; `prox_logp` given: the pre-update policy's logprobs, no grad):
        w = exp(prox_logp - behav_logp)            importance weight behaviour -> proximal
        r = exp(logp - prox_logp)                  the trust region is around the PROXIMAL policy
        l = -w' * min(r * A, clip(r, 1 - clip_low, 1 + clip_high) * A)
    with w' = w, except w' = 0 where w > `is_cap`: like AReaL (`behav_imp_weight_cap`), a token
    whose weight exceeds the cap is dropped from the loss rather than clipped to the cap; it still
    counts in the aggregation's normalizer. (Clipping w to the cap would keep a biased, full-size
    gradient from exactly the tokens the behaviour policy found least likely; masking bounds the
    loss to tokens where the correction is trustworthy.) With prox == behav, w = 1 and this is
    plain PPO.

    Returns (loss, stats); stats are detached and accumulate across micro-batches by adding
    (keys ending in `_max`: by max):
      tokens          number of loss tokens
      clipped_tokens  loss tokens whose gradient the clip removed (A > 0 and r > 1 + clip_high,
                      or A < 0 and r < 1 - clip_low)
      ratio_sum       sum of r;  ratio_max  largest r (0 when there are no loss tokens)
      approx_kl_sum   sum of the k3 estimate `(r - 1) - log r` of KL(denominator || current),
                      the denominator being the behaviour policy (plain) or the proximal one
      pg_loss         the loss itself, detached
    and, decoupled only:
      is_weight_sum, is_weight_max   of the raw w (before the cap)
      is_capped_tokens               loss tokens with w > is_cap (dropped)
    The k3 estimator with r = p_current / p_denominator is unbiased and non-negative for samples
    from the denominator policy: exactly so for plain PPO, approximately for decoupled PPO (the
    samples come from the behaviour policy, which the proximal one is close to).
    """
    if (weights is None) == (normalizer is None):
        raise ValueError("give exactly one of weights and normalizer")
    if normalizer is not None and normalizer <= 0:
        raise ValueError(f"normalizer must be > 0 (loss tokens in the batch), got {normalizer}")
    optional = [t for t in (weights, prox_logp) if t is not None]
    tensors = [logp, behav_logp, advantages, mask] + optional
    if any(t.shape != logp.shape for t in tensors):
        raise ValueError(
            "logp, behav_logp, advantages, mask (and weights, prox_logp) must share one [B, T] "
            f"shape, got {[tuple(t.shape) for t in tensors]}"
        )
    on = mask > 0
    zero = torch.zeros((), dtype=torch.float32, device=logp.device)
    if weights is None:
        assert normalizer is not None  # exactly one of them, checked above
        weights = mask.float() / normalizer
    c = torch.where(on, weights.float(), zero)
    anchor = behav_logp if prox_logp is None else prox_logp
    # Neutralise non-loss tokens first: log ratio 0 (ratio 1) and advantage 0 there.
    log_ratio = torch.where(on, logp.float() - anchor.float().detach(), zero)
    adv = torch.where(on, advantages.float(), zero)
    ratio = torch.exp(log_ratio)
    clipped_ratio = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    # Zero off the mask by construction (advantage 0 there), so a plain sum is the masked sum.
    per_token = -torch.minimum(ratio * adv, clipped_ratio * adv)

    stats: dict[str, Tensor] = {}
    if prox_logp is not None:
        with torch.no_grad():
            log_w = torch.where(on, prox_logp.float() - behav_logp.float(), zero)
            w = torch.exp(log_w)
            capped = on & (w > is_cap) if is_cap is not None else torch.zeros_like(on)
            applied = torch.where(capped | ~on, zero, w)  # also 0 * inf-free where w overflowed
            stats["is_weight_sum"] = torch.where(on, w, zero).sum()
            stats["is_weight_max"] = torch.where(on, w, zero).max() if w.numel() else zero.clone()
            stats["is_capped_tokens"] = capped.sum().float()
        per_token = applied * per_token
    loss = (c * per_token).sum()

    with torch.no_grad():
        r = ratio.detach()
        lr = log_ratio.detach()
        clipped = on & (((adv > 0) & (r > 1.0 + clip_high)) | ((adv < 0) & (r < 1.0 - clip_low)))
        stats.update(
            {
                "tokens": on.sum().float(),
                "clipped_tokens": clipped.sum().float(),
                "ratio_sum": torch.where(on, r, zero).sum(),
                # ratio > 0 everywhere, so 0 off the mask never wins the max (and is the empty answer).
                "ratio_max": torch.where(on, r, zero).max() if r.numel() else zero.clone(),
                "approx_kl_sum": torch.where(on, (r - 1.0) - lr, zero).sum(),
                "pg_loss": loss.detach(),
            }
        )
    return loss, stats


def rl_loss(
    logp: Tensor,
    entropy: Tensor,
    behav_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    weights: Tensor,
    *,
    clip_low: float,
    clip_high: float,
    prox_logp: Tensor | None = None,
    is_cap: float | None = None,
    ref_logp: Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: KLEstimator = "k3",
    entropy_coef: float = 0.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The whole learner loss of one micro-batch, every term aggregated with the same `weights`:

        loss = sum(c * l_pg) + kl_coef * sum(c * kl) - entropy_coef * sum(c * H)

    `l_pg` is `ppo_clip_loss`'s per-token term (decoupled when `prox_logp` is given), `kl` the
    `kl_penalty` estimate against `ref_logp`, `H` the per-token `entropy` (which must carry grad
    when entropy_coef > 0). The KL and entropy terms are not importance-weighted.

    Stats: `ppo_clip_loss`'s, plus `entropy_sum` (over loss tokens) and, when `ref_logp` is given,
    `kl_sum` (over loss tokens, of the chosen estimator; computed without grad when kl_coef is 0).
    """
    if kl_coef > 0 and ref_logp is None:
        raise ValueError("kl_coef > 0 needs reference logprobs")
    loss, stats = ppo_clip_loss(
        logp,
        behav_logp,
        advantages,
        mask,
        clip_low=clip_low,
        clip_high=clip_high,
        weights=weights,
        prox_logp=prox_logp,
        is_cap=is_cap,
    )
    on = mask > 0
    zero = torch.zeros((), dtype=torch.float32, device=logp.device)
    c = torch.where(on, weights.float(), zero)
    if ref_logp is not None:
        with torch.enable_grad() if kl_coef > 0 else torch.no_grad():
            kl = kl_penalty(logp, ref_logp.detach(), mask, kl_estimator)
        if kl_coef > 0:
            loss = loss + kl_coef * (c * kl).sum()
        stats["kl_sum"] = kl.detach().sum()
    ent = torch.where(on, entropy.float(), zero)
    if entropy_coef > 0:
        loss = loss - entropy_coef * (c * ent).sum()
    stats["entropy_sum"] = ent.detach().sum()
    return loss, stats
