"""The learner process: receive episodes, train on complete groups, push weights, announce.

    millstream learner [--config run.toml] actor.connect=tcp://... run.dir=runs/x
    torchrun --nproc_per_node 2 -m millstream.learner ...        (by hand; the launcher starts each rank)

This module is the process entry: it builds the trainer (DeepSpeed) and the team of ranks, then
rank 0 runs the loop (`Leader`, learner/loop/leader.py: receive, step, announce, finish) and the
other ranks follow its commands (learner/follower.py). Standard output carries one progress line
per step and nothing else (logs go to stderr), so the launcher can show it as is. The exit status
says whether the run's accounts added up (`ACCOUNTING_FAILED` otherwise).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from millstream.learner.follower import follow
from millstream.learner.loop.leader import Leader
from millstream.learner.team import Team, collective_timeout_s
from millstream.learner.train.trainer import Trainer
from millstream.shared.config import Config, ConfigError
from millstream.shared.config.trainable import sampling_problem
from millstream.shared.process.runtime import ACCOUNTING_FAILED, resolve_model_dir, run_role
from millstream.shared.wire.keys import load_keys

__all__ = ["run_learner", "check_learner", "main"]

log = logging.getLogger("learner")


def run_learner(cfg: Config, ready_file: str | None = None) -> dict:
    run_dir = Path(cfg.run.dir or f"{cfg.run.root}/{cfg.run.name}-learner")
    run_dir.mkdir(parents=True, exist_ok=True)
    keys = load_keys(cfg, "learner")  # before DeepSpeed starts: a key problem costs nothing
    problem = sampling_problem(cfg)
    if problem:
        raise ConfigError(problem)
    trainer = Trainer(
        resolve_model_dir(cfg),
        cfg.learner,
        seed=cfg.run.seed,
        dtype=cfg.learner.train_dtype,
        collective_timeout_s=collective_timeout_s(cfg),
        temperature=cfg.envpool.temperature,
    )
    team = Team()
    if not team.leader:
        follow(cfg, trainer, team)
        return {"accounting_ok": True, "follower": team.rank}
    return Leader(cfg, trainer, team, run_dir, keys).run(ready_file)


def check_learner(cfg: Config) -> str | None:
    """What the learner would refuse only after the run started, in one line, or None: sampling
    it cannot train on (`sampling_problem`), LoRA target modules that match no linear layer
    (read from the model's config, no weights)."""
    problem = sampling_problem(cfg)
    if problem:
        return problem
    if cfg.learner.lora_rank > 0:
        from millstream.learner.train.lora import check_targets

        try:
            check_targets(resolve_model_dir(cfg), cfg.learner.lora_target_modules)
        except (ValueError, ImportError) as exc:
            return str(exc)
    return None


def main(argv: list[str] | None = None) -> None:
    def body(cfg: Config, ns: Any) -> int:
        if ns.check:
            problem = check_learner(cfg)
            if problem:
                print(problem)
            return 2 if problem else 0
        summary = run_learner(cfg, ns.ready_file)
        log.info("learner finished: %s", summary)
        return 0 if summary["accounting_ok"] else ACCOUNTING_FAILED

    run_role("learner", body, argv, check="check the settings against the model and exit (2: not)")


if __name__ == "__main__":
    main()
