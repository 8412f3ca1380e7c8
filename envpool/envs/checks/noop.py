"""The do-nothing environment: measures what the envpool itself costs.

One turn. Whatever the model replies, the reward is 0.0, the reply counts as valid, and the
episode is done with an empty observation. There is nothing to parse and nothing to compute, so
a run on `noop` times the envpool's own work (admission, the chat context, the actor round trip,
shipping the trajectory) with the environment's share as close to zero as Python allows.

Anchors: "start" before the turn, "done" after it (one state each, equal across a group).
"""

from __future__ import annotations

from millstream.envpool.envs.base import Observation, StepResult, register

__all__ = ["Noop"]

# Built once: the observations are frozen, so sharing them costs nothing and allocates nothing.
_DONE = Observation("", anchor="done")


@register("noop")
class Noop:
    system_prompt = ""

    def __init__(self, prompt: str = "Say anything.") -> None:
        if not isinstance(prompt, str):
            raise ValueError(f"prompt must be a string, got {prompt!r}")
        self._start = Observation(prompt, anchor="start")

    async def reset(self, seed: int) -> Observation:
        return self._start

    async def step(self, action: str) -> StepResult:
        # A fresh info dict per step: a caller may annotate it, and a shared one would leak.
        return StepResult(_DONE, 0.0, True, {"valid": True, "success": False})
