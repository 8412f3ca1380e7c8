"""The learner process: receive episodes, train on complete groups, push weights, announce.

    millstream learner [--config run.toml] actor.connect=tcp://... run.dir=runs/x
    torchrun --nproc_per_node 2 -m millstream.learner ...        (by hand; the launcher starts each rank)

One loop on rank 0, synchronous on purpose (training is the slow part; ZeroMQ queues arriving
experience in its own I/O thread meanwhile):

1. restore a checkpoint if `run.resume` is set, attach to the actor and push the current policy
   weights as the current version, so the actor never generates for this session with weights
   the learner does not have (a resumed run continues at its checkpoint's version);
2. drain arriving `Trajectory` / `EpisodeFailed` messages into the replay buffer;
3. when enough fresh groups are complete: filter them (`learner.group_filter`), compute
   advantages, take one optimizer step, push the new weights, announce the new version and the
   admission limit (the envpool gate paces episodes by it);
4. after `train.steps` steps: announce `final`, collect every worker's `PoolDone`, count what is
   left in the buffer as dropped ("run_ended"), check the accounting identity, save.

Other ranks only follow rank 0's commands (`learner/team.py`). The version is re-announced every
second (a heartbeat): PUB/SUB drops messages sent before a subscriber connects, and the envpool
takes a silent learner as an error. Standard output carries one progress line per step and
nothing else (logs go to stderr), so the launcher can show it as is.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import msgspec
import orjson

from millstream.learner.episodes.accounting import close_accounts
from millstream.learner.episodes.experience import Experience, say
from millstream.learner.episodes.intake import Intake
from millstream.learner.episodes.records import EpisodeRecords
from millstream.learner.episodes.validate import EpisodeCheck, vocab_size
from millstream.learner.episodes.workers import WorkerLedger
from millstream.learner.evals import EvalLog
from millstream.learner.follower import follow
from millstream.learner.persist.checkpoint import find_checkpoint, load_checkpoint, save_checkpoint
from millstream.learner.replay import Group, ReplayBuffer
from millstream.learner.stats import (
    CollapseWatch,
    NoSignalWatch,
    batch_metrics,
    buffer_metrics,
    progress_line,
)
from millstream.learner.sync.fleet import Fleet, replica_weights
from millstream.learner.team import Team
from millstream.learner.train.advantages import compute_advantages, filter_groups, filter_pool_size
from millstream.learner.train.batching import train_samples
from millstream.learner.train.trainer import Trainer
from millstream.shared.config import Config
from millstream.shared.obs.dashboards import open_metrics
from millstream.shared.process.runtime import ACCOUNTING_FAILED, resolve_model_dir, run_role, write_ready
from millstream.shared.wire import (
    DropCause,
    EvalResult,
    Message,
    ReplicaJoin,
    ReplicaLeave,
    Trajectory,
    admit_limit,
    group_number,
)
from millstream.shared.wire.keys import RunKeys, load_keys

__all__ = ["run_learner", "main"]

log = logging.getLogger("learner")

#: The drop cause of groups each group filter removes.
FILTER_CAUSE = {"zero_std": DropCause.FILTERED_ZERO_STD, "starpo_s": DropCause.FILTERED_STARPO_S}


class Leader:
    """Rank 0: everything that talks to the envpool and the actor, and decides every step."""

    def __init__(
        self, cfg: Config, trainer: Trainer, team: Team, run_dir: Path, keys: RunKeys | None
    ) -> None:
        self.cfg, self.trainer, self.team, self.run_dir = cfg, trainer, team, run_dir
        self.keys = keys
        train, learner = cfg.train, cfg.learner
        bound = train.max_staleness if learner.staleness_policy == "drop" else learner.decoupled_max_staleness
        self.buffer = ReplayBuffer(train.group_size, train.groups_per_batch, bound, learner.max_buffer_groups)
        self.group_base = 0  # first group number of this session (continues after a resume)
        self.trained_groups = 0  # groups admitted and trained in this session (>= group_base)
        self.generation_budget = cfg.envpool.max_tokens * cfg.envpool.max_turns
        self.collapse = CollapseWatch()
        self.no_signal = NoSignalWatch()
        self.ledger = WorkerLedger(cfg.envpool.workers, group_base=0, group_size=train.group_size)
        check = EpisodeCheck(learner, vocab_size(resolve_model_dir(cfg)))
        self.records = EpisodeRecords(cfg, run_dir)  # every episode's fate (learner/episodes/records.py)
        self.buffer.on_drop = lambda trajs, why: self.records.dropped(trajs, str(why), self.trainer.version)
        self.intake = Intake(cfg, self.buffer, self.ledger, check, self.records.failed)
        #: This learner process; a restarted learner is a new session, and workers say hello to it.
        self.session = uuid.uuid4().hex[:12]
        self.sessions = 1  # learner sessions of this run, this one included (resumes add)
        self.greeting_until: float | None = 0.0  # admission waits for every worker's hello until then
        self.admitted = 0  # highest admission limit announced: no group at or above it started
        self.evals = EvalLog()  # evaluation rounds (learner/evals.py): metrics, never trained

    # --- admission -------------------------------------------------------------------------

    def limit(self) -> int:
        cfg = self.cfg
        if not self._all_greeted():
            return self.group_base  # nothing admitted before numbering is settled
        return admit_limit(
            group_base=self.group_base,
            consumed=self.trained_groups + self.buffer.dropped_from_floor,
            carried=0,  # earlier sessions' groups hold no slot (see _all_greeted)
            groups_per_batch=cfg.train.groups_per_batch,
            max_staleness=cfg.train.max_staleness,
            slack=cfg.envpool.admission_slack,
        )

    # --- the loop --------------------------------------------------------------------------

    def run(self, ready_file: str | None) -> dict:
        cfg, trainer = self.cfg, self.trainer
        if cfg.run.resume:
            self._resume(find_checkpoint(cfg.run.resume))
        self.fleet = Fleet(cfg, self.keys, self.run_dir)
        pushed = self.fleet.start(self._weights, trainer.version)
        log.info(
            "policy version %d pushed to %d replicas in %.2fs",
            trainer.version,
            len(self.fleet.members),
            pushed.get("sync/total_s", 0.0),
        )
        self.exp = Experience(cfg, self.keys)
        self.metrics = open_metrics(
            self.run_dir,
            cfg.metrics.backends,
            wandb_project=cfg.metrics.wandb_project,
            wandb_name=cfg.metrics.wandb_name,
            wandb_tags=cfg.metrics.wandb_tags,
            config=msgspec.to_builtins(cfg),
        )
        if cfg.run.resume:
            self.metrics.write(
                {
                    "event": "resume",
                    "step": trainer.version,
                    "checkpoint": str(find_checkpoint(cfg.run.resume)),
                }
            )
        write_ready(
            ready_file, experience=cfg.learner.experience_address, versions=cfg.learner.version_address
        )
        self.started = self.last_step = self.last_data = time.monotonic()
        self.greeting_until = self.started + min(60.0, cfg.envpool.start_timeout_s)
        announced = self.limit()
        self._announce(announced)
        while trainer.version < cfg.train.steps:
            for message in self.exp.receive(0.05):
                self._take(message, greeting=self.greeting_until is not None)
                self.last_data = time.monotonic()
            if self.intake.held and self._all_greeted():
                self.intake.release(version=trainer.version, admitted=self.admitted)
            replicas_changed = self.fleet.follow(self._weights, trainer.version)
            stepped = self._maybe_step()
            if (
                stepped
                or replicas_changed
                or time.monotonic() - self.exp.last_announce > 1.0
                or self.limit() != announced
            ):
                announced = self.limit()
                self._announce(announced)
            if not stepped and time.monotonic() - self.last_data > cfg.learner.idle_timeout_s:
                raise TimeoutError(
                    f"no experience for {cfg.learner.idle_timeout_s}s; is the envpool "
                    f"alive? buffer: {self.buffer.statistics()}"
                )
        return self._finish()

    def _all_greeted(self) -> bool:
        """Every worker said hello to this session (or their time is up); the first time it is
        so, numbering moves past every group any worker process has started, and the groups
        started before (a restarted learner's: restored, still running, or held results) are
        not this session's: consuming one admits nothing new (`ReplayBuffer.floor`). Otherwise
        each would admit a group too many, for good, and the excess would be dropped stale step
        after step. They hold no slot either: some can never complete (their other members died
        with the old learner), and a slot held by one of those would never come back. So a
        restart over-admits once, by the groups then in flight."""
        if self.greeting_until is None:
            return True
        waiting = (
            len(self.ledger.greeted) < self.cfg.envpool.workers and time.monotonic() < self.greeting_until
        )
        if waiting and len(self.intake.held) < self.intake.max_held:  # full: judge them now
            return False
        self.greeting_until = None
        self.group_base = max([self.group_base, *self.ledger.next_groups])
        self.ledger.rebase(self.group_base)
        self.admitted = max(self.admitted, self.group_base)  # every group a worker started
        self.buffer.floor, self.buffer.dropped_from_floor = self.group_base, 0
        return True

    def _announce(self, limit: int) -> None:
        self.admitted = max(self.admitted, limit)
        self.exp.announce(
            self.trainer.version,
            limit,
            self.group_base,
            next_groups=self.ledger.next_groups,
            session=self.session,
            replicas=self.fleet.announced(),
        )

    def _take(self, message: Message, *, greeting: bool) -> None:
        if isinstance(message, (ReplicaJoin, ReplicaLeave)):
            self.fleet.take(message)
            return
        if isinstance(message, EvalResult):
            self.metrics.write(self.evals.take(message))
            return
        self.intake.take(message, version=self.trainer.version, admitted=self.admitted, greeting=greeting)

    def _maybe_step(self) -> bool:
        """One training step if enough fresh complete groups wait: take, train, push, report."""
        version = self.trainer.version
        batch = self._take_batch(version)
        if not batch:
            return False
        scored = self._score(batch)
        step_metrics = self._train(scored)
        self.trained_groups += sum(1 for g in batch if group_number(g.group_id) >= self.buffer.floor)
        sync_metrics = self._push_weights()
        now = time.monotonic()
        record = {
            "step": self.trainer.version,
            "trained_version": version,
            "learner/ranks": self.team.world,
            **batch_metrics(batch, version, now - self.last_step, now - self.started),
            **{f"train/{k}": v for k, v in step_metrics.items()},
            **sync_metrics,
            **self.fleet.metrics(),
            **buffer_metrics(self.buffer.statistics()),
            **self.records.statistics(),
        }
        self.records.trained(scored, self.trainer.version, version)  # first: the record counts them
        self._report(record, step_metrics)
        self.last_step = now
        every = self.cfg.learner.checkpoint_every
        if every and self.trainer.version % every == 0 and self.trainer.version < self.cfg.train.steps:
            self._save()
        return True

    def _take_batch(self, version: int) -> list[Group]:
        """The next batch of complete, fresh-enough groups that pass the group filter."""
        cfg = self.cfg
        candidates = self.buffer.take_batch(
            version, count=filter_pool_size(cfg.learner, cfg.train.groups_per_batch)
        )
        if candidates is None:
            return []
        batch, rejected = filter_groups(candidates, cfg.learner)
        if rejected:
            self.buffer.discard(rejected, FILTER_CAUSE[cfg.learner.group_filter])
        if not batch:
            self._filtered_out_whole_batch()
        return batch

    def _filtered_out_whole_batch(self) -> None:
        """The group filter dropped a whole batch (no group had a reward spread): no step, so no
        step line either; say it here, as the step line would."""
        quiet = self.no_signal.update(1.0)
        after = self.no_signal.after
        if quiet >= after and (quiet == after or quiet % 10 == 0):
            say(
                f"NO SIGNAL: {quiet} batches in a row had equal rewards in every group (all dropped "
                f"by learner.group_filter={self.cfg.learner.group_filter}); no step was taken"
            )
            self.metrics.write({"event": "no_signal_warning", "step": self.trainer.version, "batches": quiet})

    def _score(self, batch: list[Group]) -> list[tuple[Trajectory, list[float]]]:
        """Every trajectory of the batch with its per-token advantages."""
        advantages = compute_advantages(batch, self.cfg.learner)
        return [(t, adv) for g, g_adv in zip(batch, advantages) for t, adv in zip(g.trajectories, g_adv)]

    def _train(self, scored: list[tuple[Trajectory, list[float]]]) -> dict[str, float]:
        """One optimizer step on every rank (each trains its shard of the samples)."""
        samples = [s for t, adv in scored for s in train_samples(t, adv)]
        self.team.command("train", samples)
        metrics = self.trainer.train_step(
            self.team.shard(samples), self.cfg.learner, generation_budget=self.generation_budget
        )
        return metrics

    def _report(self, record: dict, step_metrics: dict[str, float]) -> None:
        """The step's metrics record, its warnings and its progress line."""
        step = self.trainer.version
        quiet = self.no_signal.update(record["reward/frac_zero_std_groups"])
        record["warning/no_signal_steps"] = quiet
        self.metrics.write(record)
        if quiet == self.no_signal.after:
            log.warning("no learning signal: every group of the last %d batches had equal rewards", quiet)
            self.metrics.write({"event": "no_signal_warning", "step": step, "steps": quiet})
        warning = self.collapse.update(record["reward/std"], step_metrics.get("entropy"))
        if warning:
            log.warning("collapse warning at step %d: %s", step, warning)
            say(
                f"warning: reward std and entropy collapsing at step {step} "
                f"(std {warning['reward_std']:.3f} from {warning['reward_std_peak']:.3f}, entropy "
                f"{warning['entropy']:.2f} from {warning['entropy_peak']:.2f})"
            )
            self.metrics.write({"event": "collapse_warning", "step": step, **warning})
        say(progress_line(record, self.cfg.train.steps, no_signal_after=self.no_signal.after))

    # --- collective steps (every rank enters them) -----------------------------------------

    def _push_weights(self) -> dict:
        return self.fleet.push(self._weights, self.trainer.version)

    def _weights(self) -> Iterable[tuple[str, Any]]:
        self.team.command("weights")  # every rank walks the weights (ZeRO-3 gathers them)
        return self.trainer.named_weights()

    def _save(self) -> Path:
        # Where the run's records stand at this checkpoint: a resume from it marks every record
        # after these positions rolled back (shared/store/rundir.py).
        records = {"metrics.jsonl": self.metrics.position(), **self.records.positions()}
        extra = {
            "next_group": self._next_group(),
            "run_dir": str(self.run_dir),
            "records": records,
            "ledger": self.ledger.state_dict(),
            "admitted": self.admitted,
            "sessions": self.sessions,
            "foreign": self.intake.foreign,
        }
        self.team.command("save", extra)
        path = save_checkpoint(
            self.run_dir, self.trainer, self.buffer, extra, keep=self.cfg.learner.keep_checkpoints
        )
        self.metrics.write({"event": "checkpoint", "step": self.trainer.version, "path": str(path)})
        return path

    def _resume(self, path: Path) -> None:
        self.team.command("load", str(path))
        state = load_checkpoint(path, self.trainer, self.buffer)
        self.group_base = int(state["next_group"])
        if "ledger" in state:
            self.ledger.load_state_dict(state["ledger"])
            self.admitted = int(state["admitted"])
            self.sessions = int(state["sessions"]) + 1
            self.intake.foreign = int(state["foreign"])
        self.ledger.rebase(self.group_base)
        log.info(
            "resumed from %s at policy version %d (%d groups carried, numbering from %d)",
            path,
            self.trainer.version,
            int(state["restored_groups"]),
            self.group_base,
        )

    def _next_group(self) -> int:
        seen = self.buffer.max_group_number()
        return max(self.group_base, (-1 if seen is None else seen) + 1)

    # --- the end ---------------------------------------------------------------------------

    def _finish(self) -> dict:
        cfg, buffer = self.cfg, self.buffer
        # Worker 0 plays the final evaluation round before its PoolDone: wait for that too.
        evaluating = cfg.eval.timeout_s + 10 if cfg.eval.every else 0.0
        deadline = time.monotonic() + cfg.envpool.step_timeout_s + 60 + evaluating
        self.intake.release(version=self.trainer.version, admitted=self.admitted)  # they count
        while len(self.intake.done_workers) < cfg.envpool.workers and time.monotonic() < deadline:
            self.exp.announce(
                self.trainer.version,
                0,
                self.group_base,
                final=True,
                session=self.session,
                replicas=self.fleet.announced(),
            )
            for message in self.exp.receive(0.2):
                self._take(message, greeting=False)
        checkpoint = self._save()  # before the drain: its complete groups survive a resume
        buffer.drain(DropCause.RUN_ENDED)
        accounts = close_accounts(
            buffer,
            self.ledger,
            self.intake.done_workers,
            cfg.envpool.workers,
            resumed=bool(cfg.run.resume),
            foreign=self.intake.foreign,
        )
        summary = {
            "version": self.trainer.version,
            **accounts,
            "learner_sessions": self.sessions,
            "decode_errors": self.exp.codec.errors,
            "checkpoint": str(checkpoint),
            "final_weights": str(checkpoint / "hf"),
            "replica_weights": replica_weights(self.fleet.digests(), self.fleet.flat.flat),
            **self.evals.summary(self.trainer.version),
        }
        if not summary["accounting_ok"]:
            log.error("accounting does not add up: %s", summary)
        self.team.command("stop")
        self.metrics.write({"summary": summary})
        (self.run_dir / "summary.json").write_bytes(orjson.dumps(summary, option=orjson.OPT_INDENT_2))
        for closable in (self.records, self.metrics, self.fleet, self.exp):
            closable.close()
        return summary


def run_learner(cfg: Config, ready_file: str | None = None) -> dict:
    run_dir = Path(cfg.run.dir or f"{cfg.run.root}/{cfg.run.name}-learner")
    run_dir.mkdir(parents=True, exist_ok=True)
    keys = load_keys(cfg, "learner")  # before DeepSpeed starts: a key problem costs nothing
    trainer = Trainer(resolve_model_dir(cfg), cfg.learner, seed=cfg.run.seed, dtype=cfg.learner.train_dtype)
    team = Team()
    if not team.leader:
        follow(cfg, trainer, team)
        return {"accounting_ok": True, "follower": team.rank}
    return Leader(cfg, trainer, team, run_dir, keys).run(ready_file)


def check_learner(cfg: Config) -> str | None:
    """What the learner would refuse only after the run started, in one line, or None: today
    LoRA target modules that match no linear layer (read from the model's config, no weights)."""
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
