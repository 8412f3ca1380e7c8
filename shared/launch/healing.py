"""How a run heals: restart a role that died, within a budget, and (for testing) kill one now
and then.

`watch` is the launcher's loop; it asks `Healer.on_exit(name, now)` about every role that ended
early. A role that failed in a way a restart would repeat (exit status 78: its config, an import,
an address it cannot bind; shared/process/runtime.py) stops the run at once. Any other is
restarted after a backoff (`run.restart_backoff_s`, doubling per restart of that
role, at most 60 s) while it has restarts left (`run.max_restarts` each); the other roles keep
running meanwhile:
- a restarted envpool worker says hello with a new incarnation, and the learner closes the
  groups its predecessor left unfinished, counting each missing member as `worker_lost`
  (learner/episodes/workers.py); numbering continues after its predecessor's groups;
- a restarted actor replica is noticed by the learner, which forms its weight group again and
  pushes the current weights, then announces the replica again (learner/sync/fleet.py); the envpool
  retries at once, on another replica if there is one, the turns the dead one held
  (`actor_lost`, envpool/actors/router.py);
- a restarted learner resumes from its latest checkpoint in the run directory (records after it
  are marked rolled back first, as `run.resume` does); envpool and actor wait for it at the
  admission gate, every worker says hello to the new session, and the results that reached the
  dead learner after its checkpoint are counted as `learner_lost` (learner/episodes/workers.py). Without
  a checkpoint yet, a dead learner stops the run, and so does any rank of a data-parallel
  learner (`learner.ranks > 1`): its ranks cannot rejoin a group halfway (resume the run).

Chaos (`chaos.kill_every_s`) kills one random role of `chaos.roles` (SIGKILL to its process
group) on a seeded schedule. Its kills do not use up the role's restarts: they test healing,
they are not the role's fault.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from millstream.shared.config import Config, ConfigError
from millstream.shared.launch.progress import StartupProgress
from millstream.shared.process.runtime import ACCOUNTING_FAILED, SETUP_FAILED
from millstream.shared.process.supervisor import RoleProcesses
from millstream.shared.store.rundir import (
    find_checkpoint,
    mark_rolled_back,
    plan_resume,
    retire_later_checkpoints,
)

__all__ = ["Healer", "Decision", "watch"]

#: Longest backoff before a restart.
MAX_BACKOFF_S = 60.0


class HealingFailed(RuntimeError):
    """A restart that cannot be done; the run stops."""


@dataclass
class Decision:
    """What to do about a role that ended: restart it at `at` (monotonic), or stop the run."""

    restart: bool
    at: float = 0.0
    attempt: int = 0
    #: The role failed in a way every restart would repeat (exit SETUP_FAILED): not retried.
    repeats: bool = False


@dataclass
class Healer:
    cfg: Config
    run_dir: Path
    #: Restarts used per role (chaos kills excluded).
    used: dict[str, int] = field(default_factory=dict)
    #: Roles chaos killed and that have not been restarted yet.
    chaos_killed: set[str] = field(default_factory=set)
    #: Every restart and kill, for the run's summary line.
    restarts: int = 0
    kills: int = 0

    def __post_init__(self) -> None:
        self._rng = random.Random(self.cfg.chaos.seed)
        self._next_kill = self._schedule(time.monotonic())

    def restartable(self, name: str) -> bool:
        if name == "learner":
            if self.cfg.learner.ranks > 1:
                return False  # its follower ranks cannot rejoin a group halfway: resume instead
            try:
                find_checkpoint(self.run_dir)
            except FileNotFoundError:
                return False
            return True
        return name.startswith(("actor", "envpool")) or name == "judge"

    def on_exit(self, name: str, now: float, code: int = 1) -> Decision:
        """A role ended before the run did: restart it (when) or give up."""
        if name == "learner" and code == ACCOUNTING_FAILED:
            return Decision(False)  # it finished; a restart would not change its count
        if code in (SETUP_FAILED, 2):  # 2: its config or arguments did not load
            return Decision(False, attempt=self.used.get(name, 0), repeats=True)
        if not self.restartable(name):
            return Decision(False)
        if name in self.chaos_killed:
            self.chaos_killed.discard(name)
            return Decision(True, now, self.used.get(name, 0))
        used = self.used.get(name, 0)
        if used >= self.cfg.run.max_restarts:
            return Decision(False, attempt=used)
        self.used[name] = used + 1
        backoff = min(MAX_BACKOFF_S, self.cfg.run.restart_backoff_s * 2**used)
        return Decision(True, now + backoff, used + 1)

    def victim(self, alive: list[str], now: float) -> str | None:
        """The role chaos kills now, if one is due."""
        if self._next_kill is None or now < self._next_kill:
            return None
        self._next_kill = self._schedule(now)
        wanted = self.cfg.chaos.roles
        candidates = sorted(
            n for n in alive if any(n == r or n.startswith(r) for r in wanted) and self.restartable(n)
        )
        if not candidates:
            return None
        name = self._rng.choice(candidates)
        self.chaos_killed.add(name)
        self.kills += 1
        return name

    def _schedule(self, now: float) -> float | None:
        every = self.cfg.chaos.kill_every_s
        # Jitter of +-25% so kills do not fall in step with the run's own periods.
        return None if not every else now + every * self._rng.uniform(0.75, 1.25)


# --- the launcher's loop ----------------------------------------------------------------------


def watch(
    sup: RoleProcesses,
    stop: threading.Event,
    out: IO[str],
    healer: Healer,
    learner_started: Callable[[], None],
    progress: StartupProgress | None = None,
) -> int:
    """Poll the roles every 0.1 s until the learner finishes, a role dies beyond healing, or a
    signal; `learner_started` is called after each learner restart (to relay its output), and
    `progress` hears of every poll and restart (start-up lines)."""
    restarts: dict[str, float] = {}  # role -> when it is started again
    while not stop.wait(0.1):
        now, exited = time.monotonic(), sup.exited()
        if progress is not None:
            progress.poll(now)
        if exited.get("learner") == 0:
            return _learner_finished(sup)
        for name, code in exited.items():
            if name in restarts or (name.startswith(("envpool", "learner-rank")) and code == 0):
                continue  # a worker or a follower rank may finish a moment before the learner
            if not _schedule_restart(sup, healer, name, code, now, restarts, out):
                return 1
        for name, at in list(restarts.items()):
            if now >= at:
                del restarts[name]
                if progress is not None:
                    progress.started(name, now)
                try:
                    _restart(sup, healer, name, learner_started)
                except HealingFailed as exc:
                    print(f"{name} exited early, stopping the run: {exc}", file=out, flush=True)
                    return 1
        alive = [n for n in sup.procs if n not in exited and n not in restarts]
        victim = healer.victim(alive, now)
        if victim is not None:
            print(f"chaos: killing {victim} (SIGKILL)", file=out, flush=True)
            sup.kill(victim)
    print("interrupted: stopping every process", file=out, flush=True)
    return 130


def _schedule_restart(
    sup: RoleProcesses,
    healer: Healer,
    name: str,
    code: int,
    now: float,
    restarts: dict[str, float],
    out: IO[str],
) -> bool:
    """Decide about a role that ended early; False when the run must stop."""
    decision = healer.on_exit(name, now, code)
    why = sup.describe_exit(name, code)
    if not decision.restart:
        after = f" (after {decision.attempt} restarts)" if decision.attempt else ""
        if decision.repeats:
            after += " (a restart would fail the same way: not retried)"
        if name == "learner":
            print(f"learner failed{after}: {why}", file=out, flush=True)
        else:
            print(f"{name} exited early, stopping the run{after}: {why}", file=out, flush=True)
        return False
    print(
        f"{name} died ({why}); restarting it in {decision.at - now:.1f}s "
        f"(restarts used: {decision.attempt} of run.max_restarts = {healer.cfg.run.max_restarts})",
        file=out,
        flush=True,
    )
    restarts[name] = decision.at
    return True


def _restart(sup: RoleProcesses, healer: Healer, name: str, learner_started: Callable[[], None]) -> None:
    healer.restarts += 1
    if name != "learner":
        sup.restart(name)
        return
    # As `run.resume` does: the records after the checkpoint are rolled back, later checkpoints
    # retired, and the learner loads the checkpoint.
    try:
        resume = plan_resume(str(healer.run_dir))
    except ConfigError as exc:  # its checkpoint went missing: the run cannot go on
        raise HealingFailed(f"cannot restart the learner: {exc}") from None
    retire_later_checkpoints(healer.run_dir, resume.step)
    mark_rolled_back(healer.run_dir, resume.records, resume.step)
    sup.restart(name, extra_args=[f"run.resume={healer.run_dir}"])
    learner_started()


def _learner_finished(sup: RoleProcesses) -> int:
    # Workers exit by themselves after the learner's final announcement.
    deadline = time.monotonic() + 60
    workers = [n for n in sup.procs if n.startswith("envpool")]
    while time.monotonic() < deadline and not all(n in sup.exited() for n in workers):
        time.sleep(0.1)
    return 0
