"""Tests of learner.persist.checkpoint with the real Trainer (DeepSpeed ZeRO-2) on the tiny model.

The central check: train, save, train one more step (weights W1); load the checkpoint into a
FRESH Trainer and buffer, train the same step, and get W1 bit for bit, at the same version. Also:
the replay buffer round trip (its partial group dropped with a cause, accounting exact), RNG
states, `latest`, pruning, and the hf/ folder loading in transformers with the trainer's logits.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from samples import random_samples
from transformers import AutoModelForCausalLM

from millstream.learner.persist.checkpoint import (
    STATE_FILE,
    find_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from millstream.learner.replay import ReplayBuffer
from millstream.learner.train.trainer import Trainer, TrainSample
from millstream.shared.config import LearnerConfig
from millstream.shared.wire import Cause, EpisodeFailed, Trajectory

# DeepSpeed calls torch.distributed APIs that torch 2.13 deprecates; not ours to fix.
pytestmark = [pytest.mark.real, pytest.mark.filterwarnings("ignore:`torch.distributed.:FutureWarning")]

CFG = LearnerConfig(lr=1e-2, micro_batch_size=2, zero_stage=2)


def train(trainer: Trainer, samples: list[TrainSample], cfg: LearnerConfig = CFG) -> dict:
    return trainer.train_step(samples, cfg, generation_budget=32)


def samples(seed: int, n: int = 3) -> list[TrainSample]:
    return random_samples(n, seed, max_len=20)


def traj(group: str, member: int, reward: float = 1.0) -> Trajectory:
    return Trajectory(
        episode_id=f"{group}-e{member}",
        group_id=group,
        seed=0,
        env="test",
        token_ids=[1, 2, 3, 4],
        loss_mask=[0, 0, 1, 1],
        logprobs=[0, 0, -0.5, -0.5],
        versions=[-1, -1, 1, 2],
        reward=reward,
        turn_rewards=[reward],
        num_turns=1,
        group_size=3,
        duration_s=0.1,
    )


def fail(group: str, member: int) -> EpisodeFailed:
    return EpisodeFailed(f"{group}-e{member}", group, 3, Cause.ENV_ERROR, "boom")


def new_buffer() -> ReplayBuffer:
    return ReplayBuffer(group_size=3, groups_per_batch=1, max_staleness=4, max_groups=16)


def filled_buffer() -> ReplayBuffer:
    """Complete g0 (3 trajectories), complete g2 (2 + a failure), partial g5 (1 + a failure)."""
    buf = new_buffer()
    for member in range(3):
        buf.add(traj("g0", member, reward=member))
    buf.add(traj("g2", 0))
    buf.fail(fail("g2", 1))
    buf.add(traj("g2", 2, reward=0.0))
    buf.add(traj("g5", 0))
    buf.fail(fail("g5", 1))
    buf.add(traj("g0", 1))  # re-sent: a duplicate
    return buf


def accounted(stats: dict) -> None:
    gone = stats["trained"] + sum(stats["dropped"].values()) + sum(stats["failed"].values())
    assert stats["received"] == gone + stats["buffered"], stats


def weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    return dict(trainer.named_weights())


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_resume_is_bit_identical(tiny_model_dir, tmp_path):
    run_dir = tmp_path / "run"
    trainer, buf = Trainer(tiny_model_dir, CFG, seed=0), filled_buffer()
    saved_stats = buf.statistics()
    train(trainer, samples(1))
    save_checkpoint(run_dir, trainer, buf, {"trained_groups": 1}, keep=2)
    train(trainer, samples(2))
    (run_dir / "checkpoints" / ".tmp-step_000009").mkdir()  # debris of a crashed save
    random.seed(11), np.random.seed(12), torch.manual_seed(13)
    extra = {"trained_groups": 2, "group_base": 0, "nested": {"a": [1, 2]}}
    step2 = save_checkpoint(run_dir, trainer, buf, extra, keep=2)
    draws = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    w_saved = weights(trainer)
    train(trainer, samples(3))
    w1, v1 = weights(trainer), trainer.version
    step3 = save_checkpoint(run_dir, trainer, buf, {"trained_groups": 3}, keep=2)

    # latest, pruning (keep=2: step 1 gone), no debris left.
    ckpts = run_dir / "checkpoints"
    assert step2.name == "step_000002" and step3.name == "step_000003"
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step_000002", "step_000003"]
    assert (ckpts / "latest").read_text().strip() == "step_000003"
    assert find_checkpoint(run_dir) == step3 and find_checkpoint(str(step2)) == step2
    assert {p.name for p in step2.iterdir()} >= {"deepspeed", "hf", STATE_FILE}

    # A fresh trainer and buffer, resumed from step 2, take step 3 exactly as the first did.
    random.seed(0), np.random.seed(0), torch.manual_seed(0)
    fresh, fresh_buf = Trainer(tiny_model_dir, CFG, seed=0), new_buffer()
    assert fresh.version == 0
    state = load_checkpoint(find_checkpoint(step2), fresh, fresh_buf)
    assert state == {**extra, "version": 2, "restored_groups": 2}
    assert fresh.version == 2
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == draws
    for name, tensor in weights(fresh).items():
        assert torch.equal(tensor, w_saved[name]), name
    train(fresh, samples(3))
    assert fresh.version == v1 == 3
    for name, tensor in weights(fresh).items():
        assert torch.equal(tensor, w1[name]), name

    # The buffer came back: complete groups in FIFO order, the partial one still waiting.
    stats = fresh_buf.statistics()
    accounted(stats)
    assert stats["dropped"] == {} and stats["partial_groups"] == 1
    for key in ("received", "trained", "failed", "duplicates", "buffered", "dropped_groups"):
        assert stats[key] == saved_stats[key], key
    assert stats["buffered"] == 6
    assert fresh_buf.max_group_number() == 5
    assert [g.group_id for g in fresh_buf.take_batch(2, count=2)] == ["g0", "g2"]
    fresh_buf.add(traj("g5", 2))  # the partial group's last member, late: it completes
    stats = fresh_buf.statistics()
    accounted(stats)
    assert stats["partial_groups"] == 0 and stats["complete_groups"] == 1 and stats["buffered"] == 2

    # hf/ is the policy: transformers gives the trainer's logits exactly.
    ids = torch.tensor([samples(4, n=1)[0].token_ids])
    live = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    live.load_state_dict(w1, strict=True)
    saved = AutoModelForCausalLM.from_pretrained(str(step3 / "hf")).eval()
    torch.testing.assert_close(logits(saved, ids), logits(live, ids), rtol=0, atol=0)
    original = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    assert not torch.equal(logits(saved, ids), logits(original, ids))

    # Saving a version that already has a checkpoint replaces it whole.
    again = save_checkpoint(run_dir, fresh, new_buffer(), {"trained_groups": 0}, keep=2)
    assert again == step3 and find_checkpoint(run_dir) == step3
    assert load_checkpoint(step3, fresh, new_buffer())["trained_groups"] == 0
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step_000002", "step_000003"]


def test_find_checkpoint_errors_and_fallback(tmp_path):
    with pytest.raises(FileNotFoundError, match="checkpoints/latest"):
        find_checkpoint(tmp_path)
    ckpts = tmp_path / "checkpoints"
    for name in ("step_000004", "step_000010"):
        (ckpts / name).mkdir(parents=True)
        (ckpts / name / STATE_FILE).write_bytes(b"")
    (ckpts / "step_000012").mkdir()  # no state file: not a checkpoint
    (ckpts / "latest").write_text("step_000099\n")  # dangling (crash mid-replace)
    assert find_checkpoint(tmp_path) == ckpts / "step_000010"
    (ckpts / "latest").write_text("step_000004\n")
    assert find_checkpoint(tmp_path) == ckpts / "step_000004"
    assert find_checkpoint(ckpts) == ckpts / "step_000004"
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        find_checkpoint(ckpts / "step_000012")


def test_extra_is_checked_before_anything_is_written(tmp_path):
    class FakeTrainer:
        version = 1

    with pytest.raises(ValueError, match="reserved"):
        save_checkpoint(tmp_path, FakeTrainer(), new_buffer(), {"version": 3}, keep=1)
    with pytest.raises(TypeError):
        save_checkpoint(tmp_path, FakeTrainer(), new_buffer(), {"x": object()}, keep=1)
    assert not (tmp_path / "checkpoints").exists()


@pytest.mark.parametrize("zero_stage", [0, 3])
def test_resume_is_bit_identical_under_other_zero_stages(tiny_model_dir, tmp_path, zero_stage):
    cfg = LearnerConfig(lr=1e-2, micro_batch_size=2, zero_stage=zero_stage)
    trainer = Trainer(tiny_model_dir, cfg, seed=0)
    train(trainer, samples(1), cfg)
    path = save_checkpoint(tmp_path, trainer, new_buffer(), {}, keep=1)
    train(trainer, samples(3), cfg)
    w1 = weights(trainer)
    fresh = Trainer(tiny_model_dir, cfg, seed=0)
    assert load_checkpoint(find_checkpoint(tmp_path), fresh, new_buffer())["version"] == 1
    train(fresh, samples(3), cfg)
    assert fresh.version == 2
    for name, tensor in weights(fresh).items():
        assert torch.equal(tensor, w1[name]), name
    assert path.name == "step_000001"
