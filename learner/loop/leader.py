"""Rank 0's learner loop: receive episodes, train on complete groups, push weights, announce.

One loop, synchronous on purpose (training is the slow part; ZeroMQ queues arriving experience
in its own I/O thread meanwhile). `Leader.run` reads as its steps:

1. `_start`: restore a checkpoint if `run.resume` is set (learner/loop/session.py), attach to
   the actor and push the current policy weights as the current version, so the actor never
   generates for this session with weights the learner does not have (a resumed run continues
   at its checkpoint's version); open the metrics and say ready;
2. `_receive`: drain arriving `Trajectory` / `EpisodeFailed` messages into the replay buffer;
3. `_maybe_step`: when enough fresh groups are complete, filter them (`learner.group_filter`),
   compute advantages, take one optimizer step, push the new weights, report the step
   (learner/loop/report.py), save a checkpoint every `learner.checkpoint_every` steps;
4. `_announce`: the version and the admission limit (the envpool gate paces episodes by it);
5. after `train.steps` steps (or `train.max_minutes`), `_finish`: announce `final`, collect
   every worker's `PoolDone`, save, count what is left in the buffer as dropped ("run_ended"),
   check the accounting identity and write the summary (learner/loop/finish.py).

Other ranks only follow rank 0's commands (`learner/team.py`). The version is re-announced every
second (a heartbeat): PUB/SUB drops messages sent before a subscriber connects, and the envpool
takes a silent learner as an error.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import msgspec

from millstream.learner.episodes.experience import Experience, say
from millstream.learner.episodes.intake import Intake
from millstream.learner.episodes.records import EpisodeRecords
from millstream.learner.episodes.validate import EpisodeCheck, vocab_size
from millstream.learner.episodes.workers import WorkerLedger
from millstream.learner.evals import EvalLog
from millstream.learner.loop.batches import group_test, take_batch
from millstream.learner.loop.finish import close_run, final_wait_s, write_summary
from millstream.learner.loop.report import StepReport, elapsed_before
from millstream.learner.loop.saving import Saver
from millstream.learner.loop.session import Session, aligned_base, restore_session, session_state
from millstream.learner.persist.checkpoint import find_checkpoint
from millstream.learner.replay import Group, ReplayBuffer
from millstream.learner.stats import batch_metrics, buffer_metrics
from millstream.learner.sync.fleet import Fleet
from millstream.learner.team import Team
from millstream.learner.train.advantages import compute_advantages
from millstream.learner.train.batching import train_samples
from millstream.learner.train.trainer import Trainer
from millstream.shared.config import Config
from millstream.shared.obs.dashboards import open_metrics
from millstream.shared.process.runtime import resolve_model_dir, write_ready
from millstream.shared.wire import (
    EvalResult,
    Message,
    ReplicaJoin,
    ReplicaLeave,
    Settled,
    Trajectory,
    admit_limit,
    group_number,
)
from millstream.shared.wire.keys import RunKeys

__all__ = ["Leader"]

log = logging.getLogger("learner")


class Leader:
    """Rank 0: everything that talks to the envpool and the actor, and decides every step."""

    def __init__(
        self, cfg: Config, trainer: Trainer, team: Team, run_dir: Path, keys: RunKeys | None
    ) -> None:
        self.cfg, self.trainer, self.team, self.run_dir = cfg, trainer, team, run_dir
        self.keys = keys
        train, learner = cfg.train, cfg.learner
        bound = train.max_staleness if learner.staleness_policy == "drop" else learner.decoupled_max_staleness
        self.buffer = ReplayBuffer(
            train.group_size, train.groups_per_batch, bound, learner.max_buffer_groups, keep=group_test(cfg)
        )
        self.generation_budget = cfg.envpool.max_tokens * cfg.envpool.max_turns
        self.ledger = WorkerLedger(cfg.envpool.workers, group_base=0, group_size=train.group_size)
        check = EpisodeCheck(learner, vocab_size(resolve_model_dir(cfg)))
        self.records = EpisodeRecords(cfg, run_dir)  # every episode's fate (learner/episodes/records.py)
        self.buffer.on_drop = lambda trajs, why: self.records.dropped(trajs, str(why), self.trainer.version)
        self.intake = Intake(cfg, self.buffer, self.ledger, check, self.records.failed)
        self.session = Session()  # numbering and admission marks (learner/loop/session.py)
        self.greeting_until: float | None = 0.0  # admission waits for every worker's hello until then
        self.evals = EvalLog()  # evaluation rounds (learner/evals.py): metrics, never trained
        self.saver = Saver(cfg, run_dir, trainer, self.buffer)  # checkpoints and their failures

    # --- admission -------------------------------------------------------------------------

    def limit(self) -> int:
        cfg, session = self.cfg, self.session
        if not self._all_greeted():
            return session.group_base  # nothing admitted before numbering is settled
        return admit_limit(
            group_base=session.group_base,
            consumed=session.trained_groups + self.buffer.dropped_from_floor,
            carried=0,  # earlier sessions' groups hold no slot (see _all_greeted)
            groups_per_batch=cfg.train.groups_per_batch,
            max_staleness=cfg.train.max_staleness,
            slack=cfg.envpool.admission_slack,
        )

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
        session = self.session
        session.group_base = aligned_base(
            max([session.group_base, *self.ledger.next_groups]), self.intake.workers
        )
        if self.intake.aligned_from is None:  # numbers from here on follow the rule
            self.intake.aligned_from = session.group_base
        self.ledger.rebase(session.group_base)
        session.admitted = max(session.admitted, session.group_base)  # every group a worker started
        self.buffer.floor, self.buffer.dropped_from_floor = session.group_base, 0
        return True

    # --- the loop --------------------------------------------------------------------------

    def run(self, ready_file: str | None) -> dict:
        """The learner's loop until `train.steps`; on a stop or a failure its records are closed
        before the error goes on: the role exits without the interpreter's teardown
        (shared/process/runtime.py `exit_now`), so nothing else would flush them."""
        try:
            return self._run(ready_file)
        except BaseException:
            self._close_records()
            raise

    def _close_records(self) -> None:
        """Best effort on the way out: the store's queued rows and the files' buffered lines."""
        for closable in filter(None, (self.records, getattr(self, "metrics", None))):
            try:
                closable.close()
            except Exception:  # the error that stopped the loop is the one to report
                log.exception("closing %s on the way out failed", type(closable).__name__)

    def _run(self, ready_file: str | None) -> dict:
        cfg, trainer = self.cfg, self.trainer
        self._start(ready_file)
        announced = self.limit()
        self._announce(announced)
        limit_s = cfg.train.max_minutes * 60 or float("inf")  # the run's clock: see _start
        while trainer.version < cfg.train.steps and time.monotonic() - self.started < limit_s:
            self.team.beat()  # the other ranks wait inside a collective: bound that wait
            self._receive()
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

    def _start(self, ready_file: str | None) -> None:
        """Resume, push the policy to the actor, open the sockets and the metrics, say ready."""
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
            wandb_mode=cfg.metrics.wandb_mode,
            wandb_project=cfg.metrics.wandb_project,
            wandb_name=cfg.metrics.wandb_name,
            wandb_tags=cfg.metrics.wandb_tags,
            config=msgspec.to_builtins(cfg),
        )
        self.report = StepReport(cfg, self.metrics)
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
        now = self.last_step = self.last_data = time.monotonic()
        # A resumed run's clock goes on from its checkpoint's step (its records say when that was).
        self.started = now - (elapsed_before(self.run_dir, trainer.version) if cfg.run.resume else 0.0)
        self.greeting_until = now + min(60.0, cfg.envpool.start_timeout_s)

    def _receive(self) -> None:
        """Take what arrived; release the held episodes once every worker said hello."""
        for message, sender in self.exp.receive(0.05):
            if len(self.intake.held) >= self.intake.max_held:
                self._release_held()  # full: the greeting ends before the next one is taken
            self._take(message, sender, greeting=self.greeting_until is not None)
            self.last_data = time.monotonic()
        self._release_held()

    def _release_held(self) -> None:
        if self.intake.held and self._all_greeted():
            self.intake.release(version=self.trainer.version, admitted=self.session.admitted)

    def _announce(self, limit: int) -> None:
        session = self.session
        session.admitted = max(session.admitted, limit)
        self.exp.announce(
            self.trainer.version,
            limit,
            session.group_base,
            next_groups=self.ledger.next_groups,
            session=session.id,
            replicas=self.fleet.announced(),
            settled=self._settled(),
        )

    def _settled(self) -> list[Settled] | None:
        """`PolicyVersion.settled`, or None if this learner saves no checkpoint before the end."""
        return self.ledger.settled() if self.cfg.learner.checkpoint_every else None

    def _take(self, message: Message, sender: str | None, *, greeting: bool) -> None:
        if isinstance(message, (ReplicaJoin, ReplicaLeave)):
            self.fleet.take(message)
            return
        if isinstance(message, EvalResult):
            if self.intake.sent_by_its_worker(message, sender):
                self.metrics.write(self.evals.take(message))
            return
        self.intake.take(
            message, sender, version=self.trainer.version, admitted=self.session.admitted, greeting=greeting
        )

    # --- one step --------------------------------------------------------------------------

    def _maybe_step(self) -> bool:
        """One training step if enough fresh complete groups wait: take, train, push, report.
        None while the workers are greeted: the results held meanwhile may carry the dead
        learner's later versions, and only so are they told from this session's own."""
        if self.greeting_until is not None:
            return False
        version = self.trainer.version
        batch = take_batch(self.buffer, self.cfg, self.report, version)
        if not batch:
            return False
        scored = self._score(batch)
        step_metrics = self._train(scored)
        self.session.trained_groups += sum(1 for g in batch if group_number(g.group_id) >= self.buffer.floor)
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
        self.report.step(record, step_metrics, self.trainer.version)
        self.last_step = now
        every = self.cfg.learner.checkpoint_every
        if every and self.trainer.version % every == 0 and self.trainer.version < self.cfg.train.steps:
            self._save()
        return True

    def _score(self, batch: list[Group]) -> list[tuple[Trajectory, list[float]]]:
        """Every trajectory of the batch with its per-token advantages."""
        advantages = compute_advantages(batch, self.cfg.learner)
        return [(t, adv) for g, g_adv in zip(batch, advantages) for t, adv in zip(g.trajectories, g_adv)]

    # --- collective steps (every rank enters them) -----------------------------------------

    def _train(self, scored: list[tuple[Trajectory, list[float]]]) -> dict[str, float]:
        """One optimizer step on every rank (each trains its shard of the samples)."""
        samples = [s for t, adv in scored for s in train_samples(t, adv)]
        self.team.command("train", samples)
        metrics = self.trainer.train_step(
            self.team.shard(samples), self.cfg.learner, generation_budget=self.generation_budget
        )
        return metrics

    def _push_weights(self) -> dict:
        return self.fleet.push(self._weights, self.trainer.version)

    def _weights(self) -> Iterable[tuple[str, Any]]:
        self.team.command("weights")  # every rank walks the weights (ZeRO-3 gathers them)
        return self.trainer.named_weights(copy=False)  # sent before the next step changes them

    def _save(self, final: bool = False) -> Path | None:
        """A checkpoint; None if it failed and training may go on (learner/loop/saving.py)."""
        # Where the run's records stand at this checkpoint: a resume from it marks every record
        # after these positions rolled back (shared/store/rundir.py).
        records = {"metrics.jsonl": self.metrics.position(), **self.records.positions()}
        extra = session_state(self.session, self.run_dir, self.buffer, self.ledger, self.intake, records)
        self.team.command("save", extra)
        path = self.saver.save(extra, self.metrics, final)
        if path is not None:  # the workers may forget what it holds (envpool/redelivery.py)
            self.ledger.mark_saved(extra["ledger"])
        return path

    def _resume(self, path: Path) -> None:
        self.team.command("load", str(path))
        state = self.saver.load(path)
        restore_session(self.session, state, self.ledger, self.intake)
        self.intake.resumed_at = self.trainer.version
        log.info(
            "resumed from %s at policy version %d (%d groups carried, numbering from %d)",
            path,
            self.trainer.version,
            int(state["restored_groups"]),
            self.session.group_base,
        )

    # --- the end ---------------------------------------------------------------------------

    def _finish(self) -> dict:
        say(f"training done at version {self.trainer.version}; collecting the workers' last episodes")
        self._final_round()
        saving = time.monotonic()
        checkpoint = self._save(final=True)  # before the drain: its complete groups survive a resume
        assert checkpoint is not None  # a final checkpoint that failed raised
        say(f"final checkpoint saved in {time.monotonic() - saving:.1f}s: {checkpoint}")
        summary = close_run(
            self.cfg,
            version=self.trainer.version,
            checkpoint=checkpoint,
            buffer=self.buffer,
            ledger=self.ledger,
            intake=self.intake,
            sessions=self.session.count,
            decode_errors=self.exp.codec.errors,
            fleet=self.fleet,
            evals=self.evals,
        )
        # Every refusal by reason (episodes', bookkeeping's, frames'), over all sessions.
        summary["messages_refused"] = dict(self.intake.refusals.counts + self.exp.bad.counts)
        summary["checkpoints_failed"] = self.saver.failed
        summary["metrics_lost"] = self.metrics.lost  # records a full disk refused
        self.team.command("stop")
        write_summary(self.run_dir, self.metrics, summary)
        for closable in (self.records, self.metrics, self.fleet, self.exp):
            closable.close()
        return summary

    def _final_round(self) -> None:
        """Announce `final` until every worker's `PoolDone` arrived (or the wait is over)."""
        deadline = time.monotonic() + final_wait_s(self.cfg)
        self.intake.release(version=self.trainer.version, admitted=self.session.admitted)  # they count
        while len(self.intake.done_workers) < self.cfg.envpool.workers and time.monotonic() < deadline:
            self.team.beat()  # the evaluation's last episodes may take minutes
            self.exp.announce(
                self.trainer.version,
                0,
                self.session.group_base,
                final=True,
                session=self.session.id,
                replicas=self.fleet.announced(),
                settled=self._settled(),  # a learner that dies now still gets them again
            )
            for message, sender in self.exp.receive(0.2):
                self._take(message, sender, greeting=False)
