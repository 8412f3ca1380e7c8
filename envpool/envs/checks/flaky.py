"""Fault injection: wraps any environment and makes some episodes crash or hang, some replies garbage.

    envpool.env = "flaky"
    envpool.env_args = { inner = "evenchars", crash_prob = 0.1, hang_prob = 0.05, garbage_prob = 0.1 }

On each reset and step, with probability `crash_prob` the call raises, and with `hang_prob` it
sleeps for `hang_s` (longer than any sane `envpool.step_timeout_s`). The episode runner must turn
these into failures with the causes `env_error` and `env_timeout`, never into rewards, and the
accounting must still add up.

On a step, with probability `garbage_prob`, the model's reply is replaced by `GARBAGE` (a NUL, a
replacement character, no tags: what a broken sampler or a byte-level cut produces) before the
inner environment sees it. That is not a failure: the inner environment must answer it as an
invalid action with its format penalty (RAGEN), and the episode goes on; the trajectory counts it
in `invalid_actions`. This environment exists to test exactly these paths, and to stress-test
them at scale.

Faults are drawn from a generator seeded by `fault_seed` and a per-process counter of created
environments, so a run's fault pattern is reproducible, yet members of one group (same episode
seed) still fail independently.
"""

from __future__ import annotations

import itertools
import random
from typing import Any

import anyio

from millstream.envpool.envs.base import Observation, StepResult, make_env, register

__all__ = ["Flaky", "InjectedFault", "GARBAGE"]

#: The reply a garbage fault substitutes: unparseable by every environment of the suite.
GARBAGE = "\x00\ufffd#!garbage!#\ufffd"

_instances = itertools.count()


class InjectedFault(RuntimeError):
    """The exception a crash fault raises."""


@register("flaky")
class Flaky:
    def __init__(
        self,
        inner: str = "evenchars",
        inner_args: dict[str, Any] | None = None,
        crash_prob: float = 0.1,
        hang_prob: float = 0.0,
        hang_s: float = 3600.0,
        garbage_prob: float = 0.0,
        fault_seed: int = 0,
    ) -> None:
        for name, p in (("crash_prob", crash_prob), ("hang_prob", hang_prob), ("garbage_prob", garbage_prob)):
            if not 0 <= p <= 1:
                raise ValueError(f"{name} must be in [0, 1], got {p}")
        if crash_prob + hang_prob + garbage_prob > 1 + 1e-9:
            raise ValueError(
                f"crash_prob + hang_prob + garbage_prob must be <= 1, got "
                f"{crash_prob + hang_prob + garbage_prob}"
            )
        self.inner = make_env(inner, inner_args)
        self.system_prompt = getattr(self.inner, "system_prompt", "")
        self.crash_prob, self.hang_prob, self.hang_s = crash_prob, hang_prob, hang_s
        self.garbage_prob = garbage_prob
        self._rng = random.Random(fault_seed * 1_000_003 + next(_instances))

    async def _maybe_fault(self, where: str) -> bool:
        """Crash or hang as drawn; returns True when this call draws a garbage reply instead."""
        draw = self._rng.random()
        if draw < self.crash_prob:
            raise InjectedFault(f"injected crash in {where}")
        if draw < self.crash_prob + self.hang_prob:
            await anyio.sleep(self.hang_s)
        return draw >= 1 - self.garbage_prob

    async def reset(self, seed: int) -> Observation:
        await self._maybe_fault("reset")
        return await self.inner.reset(seed)

    async def step(self, action: str) -> StepResult:
        garbage = await self._maybe_fault("step")
        return await self.inner.step(GARBAGE if garbage else action)
