"""Tests of learner.trainer on the tiny model: direction of the update, the loss mask, micro-batch
splitting, and the weights going out (names, save/load round trip).

DeepSpeed's first init in a process takes seconds, so one ZeRO-2 Trainer is shared by the module;
the later Trainers of the micro-batch test start in well under a second. Adam's first update is
close to lr * sign(grad) whatever the gradient's scale, so comparing updated weights alone would not
catch a gradient scaled by the micro-batch count: the micro-batch test also checks the loss and the
pre-clip gradient norm against a plain PyTorch full-batch reference.
"""

from __future__ import annotations

import os
import random

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from learner.loss import ppo_clip_loss, sequence_logprobs
from learner.trainer import PAD_ID, Trainer, TrainSample
from shared.config import LearnerConfig

# DeepSpeed calls torch.distributed APIs that torch 2.13 deprecates; not ours to fix.
pytestmark = pytest.mark.filterwarnings("ignore:`torch.distributed.:FutureWarning")

CLIP = dict(clip_low=0.2, clip_high=0.28)


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
def sampled_sample(model, advantage: float, prompt_len: int = 6, gen_len: int = 10,
                   seed: int = 0) -> TrainSample:
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


def random_samples(n: int, seed: int) -> list[TrainSample]:
    """Sequences of different lengths (so micro-batches pad), each with a prompt and a response."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = rng.randint(8, 24)
        prompt = rng.randint(2, length - 3)
        mask = [0] * prompt + [1] * (length - prompt)
        adv = rng.uniform(-1.0, 1.0)
        out.append(TrainSample([rng.randrange(3, 512) for _ in range(length)], mask,
                               [-rng.uniform(4.0, 8.0) * m for m in mask], [adv * m for m in mask]))
    return out


def reference_step(model_dir, samples, cfg: LearnerConfig):
    """The same step in plain PyTorch: one padded batch, token-mean loss, clip, AdamW."""
    model = hf_model(model_dir).train()
    width, n = max(len(s.token_ids) for s in samples), len(samples)
    ids = torch.full((n, width), PAD_ID)
    attn, mask, behav, adv = (torch.zeros(n, width) for _ in range(4))
    for i, s in enumerate(samples):
        t = len(s.token_ids)
        ids[i, :t], attn[i, :t] = torch.tensor(s.token_ids), 1
        mask[i, :t] = torch.tensor(s.loss_mask, dtype=torch.float32)
        behav[i, :t], adv[i, :t] = torch.tensor(s.behav_logprobs), torch.tensor(s.advantages)
    logp, _ = sequence_logprobs(model(input_ids=ids, attention_mask=attn.long()).logits, ids)
    loss, _ = ppo_clip_loss(logp, behav, adv, mask, normalizer=float(mask.sum()), **CLIP)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay).step()
    return float(loss.detach()), float(norm), dict(model.named_parameters())


@pytest.mark.parametrize("advantage", [1.0, -1.0])
def test_update_direction_follows_advantage_sign(trainer, model_dir, advantage):
    before = hf_model(model_dir, trainer.named_weights())
    sample = sampled_sample(before, advantage, seed=int(advantage > 0))
    version = trainer.version
    metrics = trainer.train_step([sample], **CLIP)
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


def test_mask_zero_positions_do_not_count(trainer, tmp_path):
    base = random_samples(3, seed=1)
    noisy = []
    for s in base:
        noisy.append(TrainSample(
            # Tokens after the last loss token are context for nothing; earlier ones are context.
            s.token_ids + [7, 8, 9],
            s.loss_mask + [0, 0, 0],
            [b if m else -100.0 for b, m in zip(s.behav_logprobs, s.loss_mask)] + [5.0] * 3,
            [a if m else 42.0 for a, m in zip(s.advantages, s.loss_mask)] + [-42.0] * 3,
        ))
    # Same starting point for both steps: weights and optimizer state from a checkpoint.
    trainer.engine.save_checkpoint(str(tmp_path), tag="start")
    m_base = trainer.train_step(base, **CLIP)
    w_base = dict(trainer.named_weights())
    trainer.engine.load_checkpoint(str(tmp_path), tag="start")
    m_noisy = trainer.train_step(noisy, **CLIP)
    w_noisy = dict(trainer.named_weights())
    for key in ("loss", "grad_norm", "entropy", "ratio_mean", "approx_kl", "tokens"):
        assert m_noisy[key] == pytest.approx(m_base[key], rel=1e-5, abs=1e-7), key
    for name, tensor in w_base.items():
        torch.testing.assert_close(w_noisy[name], tensor, rtol=0, atol=1e-6)


@pytest.mark.parametrize("zero_stage", [0, 2, 3])
def test_micro_batch_split_gives_the_same_step(model_dir, zero_stage):
    samples = random_samples(4, seed=2)
    cfg = LearnerConfig(lr=1e-3, micro_batch_size=4, zero_stage=zero_stage)
    ref_loss, ref_norm, ref_weights = reference_step(model_dir, samples, cfg)
    for mbs in (1, 4):
        trainer = Trainer(model_dir, LearnerConfig(lr=1e-3, micro_batch_size=mbs,
                                                   zero_stage=zero_stage), seed=0)
        metrics = trainer.train_step(samples, **CLIP)
        assert metrics["loss"] == pytest.approx(ref_loss, rel=1e-4, abs=1e-6)
        assert metrics["grad_norm"] == pytest.approx(ref_norm, rel=1e-4)
        for name, tensor in trainer.named_weights():
            ref = ref_weights[name]
            # Adam moves a weight by ~lr * g / (|g| + 1e-8): where |g| is near 1e-8, float noise
            # (padding or not changes the sums' order) moves the update by up to lr. Elsewhere
            # the updates must agree closely; there, at most lr.
            solid = ref.grad.abs() > 1e-6
            torch.testing.assert_close(tensor[solid], ref.detach()[solid], rtol=0, atol=1e-6)
            assert float((tensor - ref.detach()).abs().max()) <= 1.01 * cfg.lr


def test_named_weights_match_checkpoint_names(trainer, model_dir):
    with safe_open(f"{model_dir}/model.safetensors", "pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    names = [name for name, _ in trainer.named_weights()]
    assert names == [name for name, _ in trainer.named_weights()]  # deterministic order
    assert "model.embed_tokens.weight" in names and "lm_head.weight" in names
    assert {n: tuple(t.shape) for n, t in trainer.named_weights()} == shapes
    assert all(not t.requires_grad for _, t in trainer.named_weights())


def test_save_pretrained_round_trips(trainer, model_dir, tmp_path):
    trainer.train_step(random_samples(2, seed=3), **CLIP)  # weights differ from model_dir's
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


@pytest.mark.parametrize("bad, message", [
    ([], "at least one"),
    ([TrainSample([5, 6], [0, 1], [0.0], [0.0, 1.0])], "same length"),
    ([TrainSample([5, 6], [1, 1], [-1.0, -1.0], [1.0, 1.0])], "loss_mask\\[0\\]"),
    ([TrainSample([5, 6], [0, 0], [0.0, 0.0], [0.0, 0.0])], "no loss-carrying"),
])
def test_bad_samples_are_refused(trainer, bad, message):
    version = trainer.version
    with pytest.raises(ValueError, match=message):
        trainer.train_step(bad, **CLIP)
    assert trainer.version == version
