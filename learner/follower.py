"""Ranks > 0 of a data-parallel learner: enter each collective step rank 0 announces.

Rank 0 (learner/loop/leader.py) decides everything and announces each collective step as a command
(learner/team.py); the other ranks only follow, in the same order, until rank 0 says stop.
"""

from __future__ import annotations

from pathlib import Path

from millstream.learner.persist.checkpoint import load_checkpoint, save_checkpoint
from millstream.learner.team import Team
from millstream.learner.train.trainer import Trainer
from millstream.shared.config import Config

__all__ = ["follow"]


def follow(cfg: Config, trainer: Trainer, team: Team) -> None:
    """Ranks > 0: enter each collective step rank 0 announces, until it says stop."""
    generation_budget = cfg.envpool.max_tokens * cfg.envpool.max_turns
    while True:
        kind, payload = team.next_command()
        if kind == "train":
            trainer.train_step(team.shard(payload), cfg.learner, generation_budget=generation_budget)
        elif kind == "weights":
            for _ in trainer.named_weights(copy=False):  # the gathers are what count
                pass
        elif kind == "save":
            save_checkpoint(
                Path(payload["run_dir"]), trainer, None, payload, keep=cfg.learner.keep_checkpoints
            )
        elif kind == "load":
            load_checkpoint(Path(payload), trainer, None)  # only rank 0 holds the buffer
        elif kind == "wait":  # rank 0 is waiting for experience: keep following
            continue
        elif kind == "stop":
            return
        else:
            raise RuntimeError(f"unknown learner command {kind!r}")
