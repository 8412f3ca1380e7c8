"""Tests of learner.train.loss: log-probabilities, the PPO clip loss (plain and decoupled), aggregations,
KL and entropy terms, masking and micro-batching. References are computed by hand."""

from __future__ import annotations

import math

import pytest
import torch

from millstream.learner.train.loss import (
    aggregation_weights,
    gather_logprobs,
    kl_penalty,
    ppo_clip_loss,
    rl_loss,
    sequence_logprobs,
)

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


def test_logprobs_are_those_of_the_sampling_temperature():
    """The actor samples from softmax(z / T) and reports that distribution's logprobs; the
    learner's passes must compute the same one (at T = 1 both were z's own, and at any other T
    the learner trained a policy nobody sampled from). Its gradient flows to the logits."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 6, 9, generator=g).requires_grad_(True)
    ids = torch.randint(0, 9, (2, 6), generator=g)
    for temperature in (0.5, 0.7, 1.3):
        logp, ent = sequence_logprobs(logits, ids, temperature=temperature)
        gathered = gather_logprobs(logits, ids, temperature=temperature)
        for b in range(2):
            for t in range(1, 6):
                p = torch.softmax(logits[b, t - 1].detach() / temperature, -1)
                assert logp[b, t].item() == pytest.approx(math.log(p[ids[b, t]].item()), abs=1e-5)
                assert gathered[b, t].item() == pytest.approx(logp[b, t].item(), abs=1e-6)
                assert ent[b, t].item() == pytest.approx(-(p * p.log()).sum().item(), abs=1e-5)
        assert not torch.allclose(logp, sequence_logprobs(logits, ids)[0])  # not T = 1's
    logp.sum().backward()
    assert logits.grad is not None and logits.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="temperature must be > 0"):
        gather_logprobs(logits, ids, temperature=0.0)


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
    loss, stats = ppo_clip_loss(
        logp,
        torch.tensor([[behav_value]]),
        torch.tensor([[adv_value]]),
        torch.ones(1, 1),
        normalizer=1.0,
        **clip,
    )
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


def _weights(mask, loss_agg, budget=8, totals_of=None):
    """Aggregation weights of `mask` with the step totals of `totals_of` (default: mask itself)."""
    on = (mask if totals_of is None else totals_of) > 0
    return aggregation_weights(
        mask, loss_agg, tokens=float(on.sum()), sequences=float(on.any(1).sum()), generation_budget=budget
    )


@pytest.mark.parametrize("decoupled", [False, True])
@pytest.mark.parametrize("loss_agg", ["token_mean", "seq_mean", "seq_sum_norm"])
def test_micro_batches_add_up_to_the_full_batch(loss_agg, decoupled):
    g = torch.Generator().manual_seed(1)
    base = torch.randn(4, 6, generator=g) - 1.0
    behav = base + 0.3 * torch.randn(4, 6, generator=g)  # ratios on both sides of the clip range
    prox = behav + 1.2 * torch.randn(4, 6, generator=g) if decoupled else None
    ref = base + 0.5 * torch.randn(4, 6, generator=g)
    ent = torch.rand(4, 6, generator=g, requires_grad=True)
    adv = torch.randn(4, 1, generator=g).expand(4, 6).contiguous()
    mask = (torch.rand(4, 6, generator=g) > 0.3).float()
    mask[0, 3:] = 0  # rows of different lengths: the three aggregations really differ
    terms = dict(
        clip_low=0.2, clip_high=0.28, is_cap=2.0 if decoupled else None, kl_coef=0.1, entropy_coef=0.01
    )
    weights = _weights(mask, loss_agg)

    full_logp = base.clone().requires_grad_(True)
    full, full_stats = rl_loss(
        full_logp, ent, behav, adv, mask, weights, prox_logp=prox, ref_logp=ref, **terms
    )
    full.backward()

    micro_logp = base.clone().requires_grad_(True)
    total = torch.zeros(())
    sums = {k: torch.zeros(()) for k in full_stats}
    for rows in (slice(0, 1), slice(1, 4)):
        # Each micro-batch's weights from its own rows and the step's totals (as the trainer).
        w = _weights(mask[rows], loss_agg, totals_of=mask)
        loss, stats = rl_loss(
            micro_logp[rows],
            ent[rows],
            behav[rows],
            adv[rows],
            mask[rows],
            w,
            prox_logp=None if prox is None else prox[rows],
            ref_logp=ref[rows],
            **terms,
        )
        loss.backward()
        total = total + loss.detach()
        for k, v in stats.items():
            sums[k] = torch.maximum(sums[k], v) if k.endswith("_max") else sums[k] + v
    assert total.item() == pytest.approx(full.item(), abs=1e-6)
    assert torch.allclose(micro_logp.grad, full_logp.grad, atol=1e-7)
    for k in full_stats:
        assert sums[k].item() == pytest.approx(full_stats[k].item(), abs=1e-5), k
    assert 0 < full_stats["clipped_tokens"].item() < mask.sum()  # the data exercised the clip
    if decoupled:
        assert 0 < full_stats["is_capped_tokens"].item() < mask.sum()  # ... and the cap
    assert not any(v.requires_grad for v in full_stats.values())
    others = {"token_mean", "seq_mean", "seq_sum_norm"} - {loss_agg}
    assert all(not torch.allclose(_weights(mask, o), weights) for o in others)  # really differ


def test_aggregations_by_hand():
    # Ratio 1 everywhere, so each loss token's loss is -A.
    adv = torch.tensor([[9.0, 1.0, 2.0, 6.0, 9.0], [9.0, 4.0, 9.0, 9.0, 9.0], [9.0] * 5])
    mask = torch.tensor([[0.0, 1, 1, 1, 0], [0.0, 1, 0, 0, 0], [0.0] * 5])  # row 2: no loss token
    logp = torch.zeros(3, 5)

    def loss(agg, budget=None):
        w = aggregation_weights(mask, agg, tokens=4, sequences=2, generation_budget=budget)
        return ppo_clip_loss(logp, logp, adv, mask, weights=w, **CLIP)[0].item()

    assert loss("token_mean") == pytest.approx(-(1 + 2 + 6 + 4) / 4)
    assert loss("seq_mean") == pytest.approx(-((1 + 2 + 6) / 3 + 4 / 1) / 2)
    assert loss("seq_sum_norm", budget=10) == pytest.approx(-(1 + 2 + 6 + 4) / (2 * 10))
    w = aggregation_weights(mask, "seq_mean", tokens=4, sequences=2)
    assert w.flatten().tolist() == pytest.approx([0, 1 / 6, 1 / 6, 1 / 6, 0, 0, 1 / 2, 0, 0, 0] + [0] * 5)
    # `normalizer` is shorthand for token_mean weights.
    by_normalizer = ppo_clip_loss(logp, logp, adv, mask, normalizer=4.0, **CLIP)[0].item()
    assert by_normalizer == loss("token_mean")
    with pytest.raises(ValueError, match="generation_budget"):
        aggregation_weights(mask, "seq_sum_norm", tokens=4, sequences=2)
    with pytest.raises(ValueError, match="loss_agg"):
        aggregation_weights(mask, "sum", tokens=4, sequences=2)
    with pytest.raises(ValueError, match="exactly one"):
        ppo_clip_loss(logp, logp, adv, mask, **CLIP)


def test_decoupled_ppo_by_hand():
    # Three loss tokens: (behav, prox, current) probabilities and advantages.
    behav = [0.5, 0.1, 0.4]
    prox = [0.6, 0.8, 0.2]  # w = 1.2, 8.0 (> cap 5: dropped), 0.5
    cur = [0.9, 0.4, 0.21]  # r = 1.5 (clipped at 1.28 for A > 0), 0.5, 1.05
    adv = [2.0, 3.0, -1.0]
    A = torch.tensor([[0.0] + adv])

    def t(probs):  # position 0 carries no loss; its logprob 0 is never read
        return torch.tensor([[1.0] + probs]).log()

    logp = t(cur).requires_grad_(True)
    mask = torch.tensor([[0.0, 1, 1, 1]])
    loss, stats = ppo_clip_loss(
        logp, t(behav), A, mask, normalizer=3.0, prox_logp=t(prox), is_cap=5.0, **CLIP
    )
    loss.backward()
    expected = -(1.2 * 1.28 * 2.0 + 0.0 + 0.5 * (1.05 * -1.0)) / 3
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    # d/dlogp of -w r A / 3 is -w r A / 3; clipped and capped tokens get none.
    assert logp.grad[0].tolist() == pytest.approx([0.0, 0.0, 0.0, 0.5 * 1.05 / 3], abs=1e-6)
    assert stats["is_weight_sum"].item() == pytest.approx(1.2 + 8.0 + 0.5, rel=1e-5)
    assert stats["is_weight_max"].item() == pytest.approx(8.0, rel=1e-5)
    assert stats["is_capped_tokens"].item() == 1
    assert stats["ratio_sum"].item() == pytest.approx(1.5 + 0.5 + 1.05, rel=1e-5)
    assert stats["clipped_tokens"].item() == 1  # token 1; token 2 has A > 0 and r < 1: kept
    # The cap is inclusive: AReaL keeps a token whose weight equals the cap.
    w_exact = float(torch.exp(t(prox) - t(behav))[0, 2])  # 8.0 up to float32 rounding
    kept, kept_stats = ppo_clip_loss(
        logp.detach(), t(behav), A, mask, normalizer=3.0, prox_logp=t(prox), is_cap=w_exact, **CLIP
    )
    assert kept_stats["is_capped_tokens"].item() == 0
    assert kept.item() == pytest.approx(expected - 8.0 * 0.5 * 3.0 / 3, rel=1e-5)


def test_decoupled_with_proximal_equal_to_behaviour_is_plain_ppo():
    g = torch.Generator().manual_seed(3)
    behav = torch.randn(3, 7, generator=g) - 2.0
    adv = torch.randn(3, 7, generator=g)
    mask = (torch.rand(3, 7, generator=g) > 0.3).float()
    results = []
    for prox in (None, behav.clone()):
        logp = behav + 0.4 * torch.randn(3, 7, generator=torch.Generator().manual_seed(4))
        logp.requires_grad_(True)
        loss, stats = ppo_clip_loss(
            logp, behav, adv, mask, weights=_weights(mask, "seq_mean"), prox_logp=prox, is_cap=5.0, **CLIP
        )
        loss.backward()
        results.append((loss.item(), logp.grad.clone(), stats))
    (plain, g_plain, s_plain), (dec, g_dec, s_dec) = results
    assert dec == pytest.approx(plain, abs=1e-7) and torch.allclose(g_dec, g_plain, atol=1e-8)
    assert s_plain["clipped_tokens"] > 0  # the clip is exercised
    assert s_dec["is_weight_sum"].item() == pytest.approx(mask.sum().item())
    assert s_dec["is_capped_tokens"].item() == 0 and "is_weight_sum" not in s_plain


def test_k1_k3_values():
    logp = torch.tensor([[0.0, math.log(0.2), math.log(0.5), math.log(0.7)]])
    ref = torch.tensor([[float("nan"), math.log(0.4), math.log(0.5), math.log(0.35)]])
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0]])
    k1 = kl_penalty(logp, ref, mask, "k1")
    k3 = kl_penalty(logp, ref, mask, "k3")
    # k1 = log(p / p_ref); k3 = p_ref / p - log(p_ref / p) - 1.
    assert k1[0].tolist() == pytest.approx([0.0, math.log(0.5), 0.0, math.log(2.0)], abs=1e-6)
    assert k3[0].tolist() == pytest.approx(
        [0.0, 2.0 - math.log(2.0) - 1.0, 0.0, 0.5 - math.log(0.5) - 1.0], abs=1e-6
    )
    assert (k3 >= 0).all() and k1[0, 1] < 0  # k3 never negative per token; k1 can be
    with pytest.raises(ValueError, match="estimator"):
        kl_penalty(logp, ref, mask, "k2")


@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_kl_term_in_the_loss(estimator):
    logp = torch.tensor([[0.0, -1.0, -2.0, -0.5]], requires_grad=True)
    ref = torch.tensor([[0.0, -1.5, -1.0, float("inf")]])  # garbage where the mask is 0
    mask = torch.tensor([[0.0, 1.0, 1.0, 0.0]])
    w = _weights(mask, "token_mean")
    args = (logp, torch.zeros(1, 4), torch.zeros(1, 4), torch.zeros(1, 4), mask, w)
    loss, stats = rl_loss(*args, ref_logp=ref, kl_coef=0.5, kl_estimator=estimator, **CLIP)
    d = [-0.5, 1.0]  # ref - logp on the two loss tokens
    per = [-x for x in d] if estimator == "k1" else [math.exp(x) - x - 1 for x in d]
    # Zero advantages: the policy term is 0 and the loss is the weighted KL alone.
    assert loss.item() == pytest.approx(0.5 * sum(per) / 2, rel=1e-6)
    assert stats["kl_sum"].item() == pytest.approx(sum(per), rel=1e-6)
    loss.backward()
    grad = [0.5 / 2 * (1.0 if estimator == "k1" else 1 - math.exp(x)) for x in d]
    assert logp.grad[0].tolist() == pytest.approx([0.0, *grad, 0.0], abs=1e-6)
    # Without a coefficient the KL is still measured, but adds nothing to the loss or graph.
    loss0, stats0 = rl_loss(*args, ref_logp=ref, kl_coef=0.0, kl_estimator=estimator, **CLIP)
    assert loss0.item() == 0.0 and stats0["kl_sum"].item() == pytest.approx(sum(per), rel=1e-6)
    with pytest.raises(ValueError, match="reference"):
        rl_loss(*args, kl_coef=0.5, **CLIP)


def test_k3_penalty_pulls_toward_the_reference():
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(2, 6, 5, generator=g, requires_grad=True)
    ref_logits = torch.randn(2, 6, 5, generator=g)
    ids = torch.randint(0, 5, (2, 6), generator=g)
    mask = torch.ones(2, 6)
    mask[:, 0] = 0

    def true_kl(lg):  # exact KL(current || reference) summed over positions
        p = torch.log_softmax(lg[:, :-1], -1)
        q = torch.log_softmax(ref_logits[:, :-1], -1)
        return float((p.exp() * (p - q)).sum())

    before = true_kl(logits.detach())
    for _ in range(30):
        logp, ent = sequence_logprobs(logits, ids)
        zeros = torch.zeros(2, 6)
        loss, _ = rl_loss(
            logp,
            ent,
            zeros,
            zeros,
            mask,
            _weights(mask, "token_mean"),
            ref_logp=gather_logprobs(ref_logits, ids),
            kl_coef=1.0,
            **CLIP,
        )
        logits.grad = None
        loss.backward()
        with torch.no_grad():
            logits -= 1.0 * logits.grad
    assert true_kl(logits.detach()) < 0.8 * before


def test_entropy_bonus_sign():
    g = torch.Generator().manual_seed(6)
    logits = torch.randn(2, 5, 4, generator=g, requires_grad=True)
    ids = torch.randint(0, 4, (2, 5), generator=g)
    mask = torch.tensor([[0.0, 1, 1, 1, 0], [0.0, 0, 1, 1, 1]])
    adv = torch.randn(2, 5, generator=g)
    w = _weights(mask, "seq_mean")
    logp, ent = sequence_logprobs(logits, ids)
    base, _ = rl_loss(logp, ent, logp.detach(), adv, mask, w, **CLIP)
    bonus, stats = rl_loss(logp, ent, logp.detach(), adv, mask, w, entropy_coef=0.3, **CLIP)
    # A BONUS: the loss (minimised) goes down by coef * aggregated entropy.
    expected = base.item() - 0.3 * float((w * ent).sum())
    assert bonus.item() == pytest.approx(expected, rel=1e-6)
    assert stats["entropy_sum"].item() == pytest.approx(float((ent * mask).sum()), rel=1e-6)
    # And a gradient step on the bonus alone raises the entropy of the loss positions.
    only, _ = rl_loss(logp, ent, logp.detach(), torch.zeros(2, 5), mask, w, entropy_coef=1.0, **CLIP)
    only.backward()
    with torch.no_grad():
        _, after = sequence_logprobs(logits - 0.5 * logits.grad, ids)
    assert float((after * mask).sum()) > float((ent.detach() * mask).sum())


def test_entropy_without_grad_matches():
    logits = torch.randn(1, 4, 6, requires_grad=True)
    ids = torch.tensor([[1, 2, 3, 4]])
    logp, ent = sequence_logprobs(logits, ids)
    logp2, ent2 = sequence_logprobs(logits, ids, entropy_grad=False)
    assert torch.equal(ent, ent2) and torch.equal(logp, logp2)
    assert ent.requires_grad and not ent2.requires_grad and logp2.requires_grad
    assert torch.equal(gather_logprobs(logits, ids), logp)


def test_all_terms_ignore_garbage_off_the_mask():
    nan, inf = float("nan"), float("inf")
    logp = torch.tensor([[-1.0, nan, -0.5, inf]], requires_grad=True)
    ent = torch.tensor([[0.7, nan, inf, nan]], requires_grad=True)
    behav = torch.tensor([[-1.2, nan, -inf, nan]])
    prox = torch.tensor([[-1.1, -inf, nan, inf]])
    ref = torch.tensor([[-0.9, inf, nan, -inf]])
    adv = torch.tensor([[1.0, nan, 3.0, -2.0]])
    mask = torch.tensor([[1.0, 0.0, 0.0, 0.0]])
    w = torch.tensor([[1.0, nan, inf, 5.0]])  # even garbage weights off the mask are ignored
    loss, stats = rl_loss(
        logp,
        ent,
        behav,
        adv,
        mask,
        w,
        prox_logp=prox,
        is_cap=5.0,
        ref_logp=ref,
        kl_coef=0.1,
        entropy_coef=0.01,
        **CLIP,
    )
    loss.backward()
    wt, r, d = math.exp(0.1), math.exp(0.1), 0.1  # w = e^(prox-behav), r = e^(logp-prox)
    expected = -wt * r * 1.0 + 0.1 * (math.exp(d) - d - 1) - 0.01 * 0.7
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert torch.isfinite(logp.grad).all() and torch.isfinite(ent.grad).all()
    assert logp.grad[0, 1:].tolist() == [0.0] * 3 and ent.grad[0, 1:].tolist() == [0.0] * 3
    assert all(torch.isfinite(v) for v in stats.values())


def test_rejects_bad_normalizer_and_shapes():
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="normalizer"):
        ppo_clip_loss(x, x, x, x, normalizer=0.0, **CLIP)
    with pytest.raises(ValueError, match="shape"):
        ppo_clip_loss(x, x, x, torch.zeros(2, 1), normalizer=1.0, **CLIP)
    with pytest.raises(ValueError, match="shape"):
        ppo_clip_loss(x, x, x, x, normalizer=1.0, prox_logp=torch.zeros(1, 3), **CLIP)
