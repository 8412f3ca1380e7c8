"""Tests of learner.loss: log-probabilities, the PPO clip loss, masking and micro-batching."""

from __future__ import annotations

import math

import pytest
import torch

from learner.loss import ppo_clip_loss, sequence_logprobs

CLIP = dict(clip_low=0.2, clip_high=0.28)


def test_sequence_logprobs_matches_a_manual_loop():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 7, generator=g, dtype=torch.float64).to(torch.bfloat16)
    ids = torch.randint(0, 7, (2, 5), generator=g)
    logp, ent = sequence_logprobs(logits, ids)
    assert logp.dtype == ent.dtype == torch.float32 and logp.shape == ent.shape == (2, 5)
    assert torch.all(logp[:, 0] == 0) and torch.all(ent[:, 0] == 0)
    for b in range(2):
        for t in range(1, 5):
            p = torch.softmax(logits[b, t - 1].float(), -1)
            assert logp[b, t].item() == pytest.approx(math.log(p[ids[b, t]].item()), abs=1e-5)
            assert ent[b, t].item() == pytest.approx(-(p * p.log()).sum().item(), abs=1e-5)


def test_entropy_is_finite_with_masked_vocabulary():
    logits = torch.zeros(1, 3, 4)
    logits[..., 2:] = float("-inf")  # two tokens impossible: uniform over two -> entropy log 2
    logits.requires_grad_(True)
    logp, ent = sequence_logprobs(logits, torch.tensor([[0, 1, 0]]))
    assert ent[0, 1:].tolist() == pytest.approx([math.log(2)] * 2)
    assert logp[0, 1:].tolist() == pytest.approx([math.log(0.5)] * 2)
    (logp.sum() + ent.sum()).backward()
    assert torch.isfinite(logits.grad).all()


def test_ratio_one_gives_minus_mean_advantage():
    logp = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.7, -1.1]])
    adv = torch.tensor([[2.0, 2.0, 2.0], [-1.0, -1.0, 5.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    loss, stats = ppo_clip_loss(logp, logp.clone(), adv, mask, normalizer=4.0, **CLIP)
    assert loss.item() == pytest.approx(-(2 + 2 - 1 - 1) / 4)
    assert stats["tokens"].item() == 4
    assert stats["ratio_sum"].item() == pytest.approx(4.0)
    assert stats["ratio_max"].item() == pytest.approx(1.0)
    assert stats["approx_kl_sum"].item() == pytest.approx(0.0, abs=1e-7)
    assert stats["clipped_tokens"].item() == 0


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_gradient_step_moves_logp_with_the_advantage(sign):
    torch.manual_seed(0)
    logits = torch.randn(1, 4, 6, requires_grad=True)
    ids = torch.tensor([[1, 2, 3, 4]])
    mask = torch.tensor([[0.0, 0.0, 1.0, 0.0]])  # only token 2 carries loss
    logp, _ = sequence_logprobs(logits, ids)
    behav = logp.detach()
    loss, _ = ppo_clip_loss(logp, behav, torch.full((1, 4), sign), mask, normalizer=1.0, **CLIP)
    loss.backward()
    with torch.no_grad():
        stepped = logits - 0.1 * logits.grad
        after, _ = sequence_logprobs(stepped, ids)
    assert sign * (after[0, 2] - behav[0, 2]).item() > 1e-3
    # Tokens without loss are untouched: only the logits row predicting token 2 got a gradient.
    assert torch.count_nonzero(logits.grad[0, [0, 2, 3]]) == 0
    assert torch.allclose(after[0, [1, 3]], behav[0, [1, 3]])


def _loss_and_grad(logp_value, behav_value, adv_value, **clip):
    logp = torch.tensor([[logp_value]], requires_grad=True)
    loss, stats = ppo_clip_loss(logp, torch.tensor([[behav_value]]), torch.tensor([[adv_value]]),
                                torch.ones(1, 1), normalizer=1.0, **clip)
    loss.backward()
    return loss.item(), logp.grad.item(), stats


def test_clipping_above_with_positive_advantage():
    r = 1.5
    loss, grad, stats = _loss_and_grad(math.log(r), 0.0, 2.0, **CLIP)
    assert loss == pytest.approx(-(1 + 0.28) * 2.0)
    assert grad == 0.0 and stats["clipped_tokens"].item() == 1
    # Inside the range: unclipped, gradient -A * ratio.
    loss, grad, stats = _loss_and_grad(math.log(1.1), 0.0, 2.0, **CLIP)
    assert loss == pytest.approx(-1.1 * 2.0) and grad == pytest.approx(-2.2)
    assert stats["clipped_tokens"].item() == 0
    # High ratio with a NEGATIVE advantage is not clipped (the pessimistic term is the raw one).
    loss, grad, stats = _loss_and_grad(math.log(r), 0.0, -2.0, **CLIP)
    assert loss == pytest.approx(r * 2.0) and grad == pytest.approx(r * 2.0)
    assert stats["clipped_tokens"].item() == 0


def test_clipping_below_with_negative_advantage():
    r = 0.5
    loss, grad, stats = _loss_and_grad(math.log(r), 0.0, -1.0, **CLIP)
    assert loss == pytest.approx(1 - 0.2)
    assert grad == 0.0 and stats["clipped_tokens"].item() == 1
    # Low ratio with a positive advantage keeps its gradient.
    loss, grad, stats = _loss_and_grad(math.log(r), 0.0, 1.0, **CLIP)
    assert loss == pytest.approx(-r) and grad == pytest.approx(-r)
    assert stats["clipped_tokens"].item() == 0
    # Asymmetric ranges are honoured: clip_low 0.6 puts 0.5 below the range only when < 0.4.
    loss, _, _ = _loss_and_grad(math.log(r), 0.0, -1.0, clip_low=0.6, clip_high=0.1)
    assert loss == pytest.approx(r)


def test_k3_kl_estimate():
    logp, behav = math.log(0.3), math.log(0.6)
    _, _, stats = _loss_and_grad(logp, behav, 1.0, **CLIP)
    r = 0.3 / 0.6
    assert stats["approx_kl_sum"].item() == pytest.approx((r - 1) - math.log(r), rel=1e-5)
    assert stats["approx_kl_sum"].item() > 0


def test_garbage_on_masked_tokens_does_not_leak():
    logp = torch.tensor([[-1.0, float("nan"), -0.5, float("inf")]], requires_grad=True)
    behav = torch.tensor([[-1.2, float("nan"), float("-inf"), float("nan")]])
    adv = torch.tensor([[1.0, float("nan"), 3.0, -2.0]])
    mask = torch.tensor([[1.0, 0.0, 0.0, 0.0]])
    loss, stats = ppo_clip_loss(logp, behav, adv, mask, normalizer=1.0, **CLIP)
    loss.backward()
    assert loss.item() == pytest.approx(-math.exp(0.2) * 1.0)
    assert torch.isfinite(logp.grad).all()
    assert logp.grad[0, 1:].tolist() == [0.0, 0.0, 0.0]
    assert all(torch.isfinite(v) for v in stats.values())
    assert stats["tokens"].item() == 1


def test_micro_batches_add_up_to_the_full_batch():
    g = torch.Generator().manual_seed(1)
    base = torch.randn(4, 6, generator=g) - 1.0
    behav = base + 0.3 * torch.randn(4, 6, generator=g)  # ratios on both sides of the clip range
    adv = torch.randn(4, 1, generator=g).expand(4, 6).contiguous()
    mask = (torch.rand(4, 6, generator=g) > 0.3).float()
    n = mask.sum().item()

    full_logp = base.clone().requires_grad_(True)
    full, full_stats = ppo_clip_loss(full_logp, behav, adv, mask, normalizer=n, **CLIP)
    full.backward()

    micro_logp = base.clone().requires_grad_(True)
    total = torch.zeros(())
    sums = {k: torch.zeros(()) for k in full_stats}
    for rows in (slice(0, 1), slice(1, 4)):
        loss, stats = ppo_clip_loss(micro_logp[rows], behav[rows], adv[rows], mask[rows],
                                    normalizer=n, **CLIP)
        loss.backward()
        total = total + loss.detach()
        for k, v in stats.items():
            sums[k] = torch.maximum(sums[k], v) if k == "ratio_max" else sums[k] + v
    assert total.item() == pytest.approx(full.item(), abs=1e-6)
    assert torch.allclose(micro_logp.grad, full_logp.grad, atol=1e-7)
    for k in full_stats:
        assert sums[k].item() == pytest.approx(full_stats[k].item(), abs=1e-5), k
    assert 0 < full_stats["clipped_tokens"].item() < n  # the data exercised the clip
    assert not any(v.requires_grad for v in full_stats.values())


def test_rejects_bad_normalizer_and_shapes():
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="normalizer"):
        ppo_clip_loss(x, x, x, x, normalizer=0.0, **CLIP)
    with pytest.raises(ValueError, match="shape"):
        ppo_clip_loss(x, x, x, torch.zeros(2, 1), normalizer=1.0, **CLIP)
