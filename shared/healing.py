"""How a run heals: restart a role that died, within a budget, and (for testing) kill one now
and then.

The launcher asks `Healer.on_exit(name, code)` about every role that ended early. An envpool
worker or the actor is restarted after a backoff (`run.restart_backoff_s`, doubling per restart
of that role, at most 60 s) while it has restarts left (`run.max_restarts` each); the other roles
keep running meanwhile:
- a restarted envpool worker says hello with a new incarnation, and the learner closes the
  groups its predecessor left unfinished, counting each missing member as `worker_lost`
  (learner/workers.py); numbering continues after its predecessor's groups;
- a restarted actor is noticed by the learner, which attaches again and pushes the current
  weights (learner/actorlink.py); the envpool retries turns that timed out meanwhile.
The learner is not restarted here: a learner that dies stops the run, which resumes from its
latest checkpoint (`run.resume`).

Chaos (`chaos.kill_every_s`) kills one random role of `chaos.roles` (SIGKILL to its process
group) on a seeded schedule. Its kills do not use up the role's restarts: they test healing,
they are not the role's fault.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

from .config import Config

__all__ = ["Healer", "Decision"]

#: Longest backoff before a restart.
MAX_BACKOFF_S = 60.0


@dataclass
class Decision:
    """What to do about a role that ended: restart it at `at` (monotonic), or stop the run."""

    restart: bool
    at: float = 0.0
    attempt: int = 0


@dataclass
class Healer:
    cfg: Config
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

    @staticmethod
    def restartable(name: str) -> bool:
        return name == "actor" or name.startswith("envpool")

    def on_exit(self, name: str, now: float) -> Decision:
        """A role ended before the run did: restart it (when) or give up."""
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
        candidates = sorted(n for n in alive if any(n == r or n.startswith(r) for r in wanted))
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
