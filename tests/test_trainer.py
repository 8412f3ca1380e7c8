"""Tests of learner.train.trainer on the tiny model: direction of the update, the loss mask, micro-batch
splitting under every aggregation, decoupled PPO, the KL penalty, and the weights going out (names,
save/load round trip).

DeepSpeed's first init in a process takes seconds, so one ZeRO-2 Trainer is shared by the module;
the later Trainers of the micro-batch test start in well under a second. Adam's first update is
close to lr * sign(grad) whatever the gradient's scale, so comparing updated weights alone would not
catch a gradient scaled by the micro-batch count: the micro-batch test also checks the loss and the
pre-clip gradient norm against a plain PyTorch full-batch reference, and the two micro-batch sizes'
weights against each other.
"""

from __future__ import annotations

import os
import random

import pytest
import torch
from safetensors import safe_open
from samples import random_samples
from transformers import AutoModelForCausalLM, AutoTokenizer

from millstream.learner.train.loss import aggregation_weights, gather_logprobs, rl_loss, sequence_logprobs
from millstream.learner.train.trainer import PAD_ID, Trainer, TrainSample
from millstream.shared.config import LearnerConfig

# DeepSpeed calls torch.distributed APIs that torch 2.13 deprecates; not ours to fix.
pytestmark = [pytest.mark.real, pytest.mark.filterwarnings("ignore:`torch.distributed.:FutureWarning")]

STEP = LearnerConfig(clip_low=0.2, clip_high=0.28)  # the loss part of the config: plain PPO clip
BUDGET = 32  # generation budget: more than any random_samples sequence's loss tokens
# Every loss term at once: decoupled PPO, seq_mean, KL (needs a Trainer built with kl_coef > 0).
EVERYTHING = dict(
    loss_agg="seq_mean", staleness_policy="decoupled", is_cap=2.0, kl_coef=0.5, entropy_coef=0.01
)


def step(trainer, samples, cfg=STEP, budget=BUDGET):
    return trainer.train_step(samples, cfg, generation_budget=budget)


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):  # conftest's session-wide tiny model (build_tiny_model, seed 0)
    return tiny_model_dir


@pytest.fixture(scope="module")
def trainer(model_dir):
    launched = "RANK" in os.environ  # under a real launcher the variables are the launcher's
    trainer = Trainer(model_dir, LearnerConfig(lr=1e-2, micro_batch_size=4, zero_stage=2), seed=0)
    if not launched:
        # The stand-in launcher variables must not leak to child processes (actor, learner).
        assert not {"RANK", "WORLD_SIZE", "MASTER_PORT"} & set(os.environ)
    return trainer


def hf_model(model_dir, weights=None):
    """A plain transformers model, optionally with the trainer's weights, for independent checks."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if weights is not None:
        model.load_state_dict(dict(weights), strict=True)
    return model


@torch.no_grad()
def logprobs(model, token_ids: list[int]) -> torch.Tensor:
    ids = torch.tensor([token_ids])
    return sequence_logprobs(model(input_ids=ids).logits, ids)[0][0]


@torch.no_grad()
def sampled_sample(
    model, advantage: float, prompt_len: int = 6, gen_len: int = 10, seed: int = 0
) -> TrainSample:
    """A sequence whose tail was sampled from `model`, with on-policy behaviour logprobs."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, model.config.vocab_size, (1, prompt_len), generator=g)
    for _ in range(gen_len):
        probs = torch.softmax(model(input_ids=ids).logits[0, -1], -1)
        ids = torch.cat([ids, torch.multinomial(probs, 1, generator=g)[None]], 1)
    token_ids = ids[0].tolist()
    mask = [0] * prompt_len + [1] * gen_len
    behav = [lp * m for lp, m in zip(logprobs(model, token_ids).tolist(), mask)]
    return TrainSample(token_ids, mask, behav, [advantage * m for m in mask])


def padded(samples):
    width, n = max(len(s.token_ids) for s in samples), len(samples)
    ids = torch.full((n, width), PAD_ID)
    attn, mask, behav, adv = (torch.zeros(n, width) for _ in range(4))
    for i, s in enumerate(samples):
        t = len(s.token_ids)
        ids[i, :t], attn[i, :t] = torch.tensor(s.token_ids), 1
        mask[i, :t] = torch.tensor(s.loss_mask, dtype=torch.float32)
        behav[i, :t], adv[i, :t] = torch.tensor(s.behav_logprobs), torch.tensor(s.advantages)
    return ids, attn.long(), mask, behav, adv


def reference_step(model_dir, samples, cfg: LearnerConfig, budget: int = BUDGET):
    """The same step in plain PyTorch: one padded batch, the whole loss at once, clip, AdamW."""
    model = hf_model(model_dir).train()
    ids, attn, mask, behav, adv = padded(samples)
    frozen = hf_model(model_dir)  # the initial weights: proximal policy and reference alike
    with torch.no_grad():
        before = gather_logprobs(frozen(input_ids=ids, attention_mask=attn).logits, ids)
    logp, ent = sequence_logprobs(model(input_ids=ids, attention_mask=attn).logits, ids)
    on = mask > 0
    weights = aggregation_weights(
        mask, cfg.loss_agg, tokens=float(on.sum()), sequences=float(on.any(1).sum()), generation_budget=budget
    )
    decoupled = cfg.staleness_policy == "decoupled"
    loss, _ = rl_loss(
        logp,
        ent,
        behav,
        adv,
        mask,
        weights,
        clip_low=cfg.clip_low,
        clip_high=cfg.clip_high,
        prox_logp=before if decoupled else None,
        is_cap=cfg.is_cap if decoupled else None,
        ref_logp=before if cfg.kl_coef > 0 else None,
        kl_coef=cfg.kl_coef,
        kl_estimator=cfg.kl_estimator,
        entropy_coef=cfg.entropy_coef,
    )
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay).step()
    return float(loss.detach()), float(norm), dict(model.named_parameters())


@pytest.mark.parametrize("advantage", [1.0, -1.0])
def test_update_direction_follows_advantage_sign(trainer, model_dir, advantage):
    before = hf_model(model_dir, trainer.named_weights())
    sample = sampled_sample(before, advantage, seed=int(advantage > 0))
    version = trainer.version
    metrics = step(trainer, [sample])
    after = hf_model(model_dir, trainer.named_weights())
    mask = torch.tensor(sample.loss_mask, dtype=torch.bool)
    delta = logprobs(after, sample.token_ids) - logprobs(before, sample.token_ids)
    change = float(delta[mask].sum())
    assert change * advantage > 0, change
    assert trainer.version == version + 1
    # On-policy: ratios are 1, nothing clipped, KL 0.
    assert metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-4)
    assert metrics["clip_frac"] == 0.0 and metrics["approx_kl"] == pytest.approx(0.0, abs=1e-6)
    assert metrics["tokens"] == sum(sample.loss_mask) and metrics["sequences"] == 1
    assert metrics["entropy"] > 0 and metrics["grad_norm"] > 0 and metrics["step_time_s"] > 0
    assert metrics["loss"] == metrics["pg_loss"] == pytest.approx(-advantage, rel=1e-4)
    assert not {"kl", "is_weight_mean", "is_weight_max", "is_capped_frac"} & set(metrics)


@pytest.fixture(scope="module")
def kl_trainer(model_dir):
    """A ZeRO-3 Trainer with a reference policy (kl_coef > 0 at construction)."""
    return Trainer(model_dir, LearnerConfig(lr=1e-2, micro_batch_size=2, zero_stage=3, kl_coef=0.5), seed=0)


@pytest.mark.parametrize("everything", [False, True])
def test_mask_zero_positions_do_not_count(trainer, kl_trainer, tmp_path, everything):
    tr, cfg = (kl_trainer, LearnerConfig(**EVERYTHING)) if everything else (trainer, STEP)
    base = random_samples(3, seed=1)
    noisy = []
    nan = float("nan")
    for s in base:
        noisy.append(
            TrainSample(
                # Tokens after the last loss token are context for nothing; earlier ones are context.
                s.token_ids + [7, 8, 9],
                s.loss_mask + [0, 0, 0],
                [b if m else nan for b, m in zip(s.behav_logprobs, s.loss_mask)] + [5.0, nan, -1e9],
                [a if m else 42.0 for a, m in zip(s.advantages, s.loss_mask)] + [-42.0, nan, 1e9],
            )
        )
    # Same starting point for both steps: weights and optimizer state from a checkpoint.
    tr.engine.save_checkpoint(str(tmp_path), tag="start")
    m_base = step(tr, base, cfg)
    w_base = dict(tr.named_weights())
    tr.engine.load_checkpoint(str(tmp_path), tag="start")
    m_noisy = step(tr, noisy, cfg)
    w_noisy = dict(tr.named_weights())
    keys = ["loss", "pg_loss", "grad_norm", "entropy", "ratio_mean", "approx_kl", "tokens"]
    keys += ["kl", "is_weight_mean", "is_capped_frac"] if everything else []
    for key in keys:
        assert m_noisy[key] == pytest.approx(m_base[key], rel=1e-5, abs=1e-7), key
    # Different padding reorders float sums; where a gradient is ~1e-8 (Adam's eps; e.g. the key
    # biases, whose exact gradient is 0), Adam's first update lr * g / (|g| + eps) turns that
    # noise into up to lr. The loss and grad_norm checks above are the sharp ones; the weights
    # must agree to 1e-6 almost everywhere (a real difference in the gradient moves nearly all
    # of them) and never by more than lr.
    loose = total = 0
    for name, tensor in w_base.items():
        off = (w_noisy[name] - tensor).abs()
        loose, total = loose + int((off > 1e-6).sum()), total + off.numel()
        assert float(off.max()) <= 1.01 * 1e-2, name
    assert loose <= total // 1000, (loose, total)


@pytest.mark.parametrize("loss", ["token_mean", "seq_mean", "seq_sum_norm", "everything"])
@pytest.mark.parametrize("zero_stage", [0, 2, 3])
def test_micro_batch_split_gives_the_same_step(model_dir, zero_stage, loss):
    samples = random_samples(4, seed=2)
    terms = EVERYTHING if loss == "everything" else dict(loss_agg=loss)
    cfg = LearnerConfig(lr=1e-3, micro_batch_size=4, zero_stage=zero_stage, **terms)
    ref_loss, ref_norm, ref_weights = reference_step(model_dir, samples, cfg)
    updated = []
    for mbs in (1, 4):
        trainer = Trainer(
            model_dir, LearnerConfig(lr=1e-3, micro_batch_size=mbs, zero_stage=zero_stage, **terms), seed=0
        )
        metrics = step(trainer, samples, cfg)
        assert metrics["loss"] == pytest.approx(ref_loss, rel=1e-4, abs=1e-6)
        assert metrics["grad_norm"] == pytest.approx(ref_norm, rel=1e-4)
        weights = dict(trainer.named_weights())
        updated.append(weights)
        for name, tensor in weights.items():
            ref = ref_weights[name]
            # Adam moves a weight by ~lr * g / (|g| + 1e-8): where |g| is near 1e-8, float noise
            # (padding or not changes the sums' order) moves the update by up to lr. Elsewhere
            # the updates must agree closely; there, at most lr.
            solid = ref.grad.abs() > 1e-6
            torch.testing.assert_close(tensor[solid], ref.detach()[solid], rtol=0, atol=1e-6)
            assert float((tensor - ref.detach()).abs().max()) <= 1.01 * cfg.lr
    # Micro-batch size 1 and 4 give the same updated weights (where the gradient is not noise).
    for name, tensor in updated[0].items():
        solid = ref_weights[name].grad.abs() > 1e-6
        torch.testing.assert_close(tensor[solid], updated[1][name][solid], rtol=0, atol=1e-6)
    if loss == "everything":
        assert 0 < metrics["is_capped_frac"] < 1 and metrics["kl"] == pytest.approx(0, abs=1e-6)


def on_policy(samples, model, seed):
    """The samples with behaviour logprobs from `model` and fresh random advantages."""
    rng = random.Random(seed)
    out = []
    for s in samples:
        adv = rng.uniform(-1.0, 1.0)
        lp = logprobs(model, s.token_ids).tolist()
        out.append(
            TrainSample(
                s.token_ids,
                s.loss_mask,
                [x * m for x, m in zip(lp, s.loss_mask)],
                [adv * m for m in s.loss_mask],
            )
        )
    return out


@torch.no_grad()
def true_kl(model, reference, samples) -> float:
    """Exact KL(model || reference) over the vocabulary, mean over loss positions."""
    ids, attn, mask, _, _ = padded(samples)
    p = torch.log_softmax(model(input_ids=ids, attention_mask=attn).logits[:, :-1], -1)
    q = torch.log_softmax(reference(input_ids=ids, attention_mask=attn).logits[:, :-1], -1)
    kl = (p.exp() * (p - q)).sum(-1)
    return float((kl * mask[:, 1:]).sum() / mask[:, 1:].sum())


def test_kl_penalty_pulls_toward_the_reference(model_dir):
    initial = hf_model(model_dir)
    prompts = random_samples(8, seed=7)
    drift = {}
    for kl_coef in (0.0, 1.0):
        # A small lr: Adam moves every weight by ~lr a step, and at 1e-3 the tiny model's
        # distributions are far apart (KL > 2 nats) after a few steps, penalty or not.
        trainer = Trainer(
            model_dir, LearnerConfig(lr=1e-4, micro_batch_size=4, zero_stage=2, kl_coef=kl_coef), seed=0
        )
        cfg = LearnerConfig(kl_coef=kl_coef)  # k3, the default (k1 as a loss does not pull back)
        history = []
        for k in range(8):  # random advantages, on-policy: a random walk away from the start
            current = hf_model(model_dir, trainer.named_weights())
            history.append(step(trainer, on_policy(prompts, current, seed=k), cfg))
        drift[kl_coef] = true_kl(hf_model(model_dir, trainer.named_weights()), initial, prompts)
        if kl_coef:
            # Reported: 0 at the first step (policy == reference), then positive.
            assert history[0]["kl"] == pytest.approx(0.0, abs=1e-6)
            assert all(m["kl"] > 0 for m in history[1:])
            # token_mean aggregates the KL like the metric (mean per token): loss = pg + coef * kl.
            for m in history:
                assert m["loss"] == pytest.approx(m["pg_loss"] + kl_coef * m["kl"], abs=1e-6)
            # With a reference, the KL is measured even on steps without the penalty.
            off = step(trainer, on_policy(prompts, initial, seed=9), LearnerConfig(kl_coef=0.0))
            assert off["kl"] > 0 and off["loss"] == pytest.approx(off["pg_loss"])
        else:
            assert trainer.reference is None and "kl" not in history[-1]
    assert drift[0.0] > 0
    assert drift[1.0] < 0.5 * drift[0.0], drift


def test_decoupled_with_stale_behaviour(trainer, model_dir):
    samples = random_samples(6, seed=8)
    current = hf_model(model_dir, trainer.named_weights())  # the proximal policy
    shifts = [-1.0, 0.5, 2.0, 0.0]  # log w = prox - behav: w = 0.37, 1.65, 7.39 (> cap 5), 1
    stale, w_all, pg = [], [], 0.0
    for s in samples:
        prox = logprobs(current, s.token_ids).tolist()
        behav, t = [], 0
        for lp, m, a in zip(prox, s.loss_mask, s.advantages):
            if not m:
                behav.append(0.0)
                continue
            shift = shifts[t % len(shifts)]
            t += 1
            behav.append(lp - shift)
            w = torch.tensor(shift).exp().item()
            w_all.append(w)
            pg += -(w if w <= 5.0 else 0.0) * a  # ratio 1 (one update): min(r A, clip(r) A) = A
        stale.append(TrainSample(s.token_ids, s.loss_mask, behav, s.advantages))
    n = len(w_all)
    metrics = step(trainer, stale, LearnerConfig(staleness_policy="decoupled", is_cap=5.0))
    assert metrics["tokens"] == n
    assert metrics["is_weight_mean"] == pytest.approx(sum(w_all) / n, rel=1e-4)
    assert metrics["is_weight_max"] == pytest.approx(max(w_all), rel=1e-4)
    assert metrics["is_capped_frac"] == pytest.approx(sum(w > 5.0 for w in w_all) / n)
    assert 0 < metrics["is_capped_frac"] < 1
    assert metrics["pg_loss"] == pytest.approx(pg / n, rel=1e-4, abs=1e-6)
    # Proximal = the weights the step starts from: the ratio is 1, nothing clipped.
    assert metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    assert metrics["ratio_max"] == pytest.approx(1.0, abs=1e-5)
    assert metrics["clip_frac"] == 0.0 and metrics["approx_kl"] == pytest.approx(0.0, abs=1e-6)


def test_named_weights_match_checkpoint_names(trainer, model_dir):
    with safe_open(f"{model_dir}/model.safetensors", "pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118 (a safetensors handle, not a dict)
    names = [name for name, _ in trainer.named_weights()]
    assert names == [name for name, _ in trainer.named_weights()]  # deterministic order
    assert "model.embed_tokens.weight" in names and "lm_head.weight" in names
    assert {n: tuple(t.shape) for n, t in trainer.named_weights()} == shapes
    assert all(not t.requires_grad for _, t in trainer.named_weights())


def test_save_pretrained_round_trips(trainer, model_dir, tmp_path):
    step(trainer, random_samples(2, seed=3))  # weights differ from model_dir's
    trainer.save_pretrained(str(tmp_path))
    saved = AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    live = hf_model(model_dir, trainer.named_weights())
    original = hf_model(model_dir)
    ids = torch.tensor([random_samples(1, seed=4)[0].token_ids])
    with torch.no_grad():
        logits = saved(input_ids=ids).logits
        torch.testing.assert_close(logits, live(input_ids=ids).logits, rtol=0, atol=0)
        assert not torch.equal(logits, original(input_ids=ids).logits)
    assert saved.config.use_cache and saved.config.dtype == torch.float32
    tok_src = AutoTokenizer.from_pretrained(model_dir)
    tok_out = AutoTokenizer.from_pretrained(str(tmp_path))
    assert tok_out("hello world")["input_ids"] == tok_src("hello world")["input_ids"]
    assert tok_out.chat_template == tok_src.chat_template


GOOD = TrainSample([5, 6, 7], [0, 1, 1], [0.0, -1.0, -1.0], [0.0, 1.0, 1.0])


@pytest.mark.parametrize(
    "bad, cfg, budget, message",
    [
        ([], STEP, BUDGET, "at least one"),
        ([TrainSample([5, 6], [0, 1], [0.0], [0.0, 1.0])], STEP, BUDGET, "same length"),
        ([TrainSample([5, 6], [1, 1], [-1.0, -1.0], [1.0, 1.0])], STEP, BUDGET, "loss_mask\\[0\\]"),
        ([TrainSample([5, 6], [0, 0], [0.0, 0.0], [0.0, 0.0])], STEP, BUDGET, "no loss-carrying"),
        ([GOOD], STEP, 0, "generation_budget"),
        ([GOOD], LearnerConfig(loss_agg="seq_sum_norm"), 1, "exceed generation_budget"),
        ([GOOD], LearnerConfig(kl_coef=0.1), BUDGET, "build the Trainer with"),
    ],
)
def test_bad_samples_are_refused(trainer, bad, cfg, budget, message):
    version = trainer.version
    with pytest.raises(ValueError, match=message):
        trainer.train_step(bad, cfg, generation_budget=budget)
    assert trainer.version == version
